"""A transformer written the way published Flax NNX models are (tests/engine/test_engine_models.py).

It has what the GPT of jaxdist.models does not: RoPE positions and a padding mask passed to every
block as side inputs, blocks returning `(cache, x)`, grouped-query attention (4 q heads, 2 k/v
heads), interleaved sliding-window / global layers with different RoPE bases (static attributes),
layers stacked with `nnx.vmap` and run with `nnx.scan`, `nnx.with_partitioning` annotations
(created under the mesh with logical axis rules, so the parameters arrive sharded), and a loss
normalized by the number of real tokens, with metrics as aux.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdist.engine.run import Units
from jaxdist.tp import plan as tp_plan


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 64
    d: int = 32
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 8
    mlp: int = 64
    pairs: int = 2  # (sliding-window, global) layer pairs
    window: int = 3
    stacked: bool = True  # layers stacked with nnx.vmap (else an nnx.List of blocks)


LOCAL_BASE, GLOBAL_BASE = 10_000.0, 1_000_000.0


def dense(n_in: int, n_out: int, names: tuple, rngs: nnx.Rngs) -> nnx.Linear:
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), names)
    return nnx.Linear(n_in, n_out, use_bias=False, kernel_init=init, rngs=rngs)


def rms_norm(d: int, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(d, scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ("embed",)), rngs=rngs)


def rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """Rotary embedding of x (batch, seq, heads, head_dim) at positions (batch, seq)."""
    half = x.shape[-1] // 2
    angle = positions[:, :, None, None] * base ** (-jnp.arange(half) / half)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * jnp.cos(angle) - x2 * jnp.sin(angle), x2 * jnp.cos(angle) + x1 * jnp.sin(angle)], -1)


class Attention(nnx.Module):
    """Grouped-query attention with RoPE, a padding mask and an optional sliding window."""

    def __init__(self, cfg: Config, window: int | None, rope_base: float, rngs: nnx.Rngs):
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.window, self.rope_base = window, rope_base
        hd = cfg.head_dim
        self.q = dense(cfg.d, cfg.n_heads * hd, ("embed", "heads"), rngs)
        self.k = dense(cfg.d, cfg.n_kv_heads * hd, ("embed", "kv_heads"), rngs)
        self.v = dense(cfg.d, cfg.n_kv_heads * hd, ("embed", "kv_heads"), rngs)
        self.o = dense(cfg.n_heads * hd, cfg.d, ("heads", "embed"), rngs)

    def __call__(self, x, positions, mask, cache=None):
        def heads(a, n):
            return a.reshape(*a.shape[:-1], n, a.shape[-1] // n)

        q = rope(heads(self.q(x), self.n_heads), positions, self.rope_base)
        k = rope(heads(self.k(x), self.n_kv_heads), positions, self.rope_base)
        v = heads(self.v(x), self.n_kv_heads)
        k_pos, k_mask = positions, mask
        if cache is not None:  # decoding: the cached keys come first
            k, v = jnp.concatenate([cache["k"], k], 1), jnp.concatenate([cache["v"], v], 1)
            k_pos, k_mask = jnp.concatenate([cache["pos"], positions], 1), jnp.concatenate([cache["mask"], mask], 1)
            cache = {"k": k, "v": v, "pos": k_pos, "mask": k_mask}
        group = self.n_heads // self.n_kv_heads
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(q.shape[-1])
        dist = positions[:, :, None] - k_pos[:, None, :]
        allowed = (dist >= 0) & k_mask[:, None, :]
        if self.window is not None:
            allowed &= dist < self.window
        scores = jnp.where(allowed[:, None], scores, -1e30)
        att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return cache, self.o(att.reshape(*att.shape[:-2], -1))


class Block(nnx.Module):
    def __init__(self, cfg: Config, window: int | None, rope_base: float, rngs: nnx.Rngs):
        self.attn_norm = rms_norm(cfg.d, rngs)
        self.attn = Attention(cfg, window, rope_base, rngs)
        self.mlp_norm = rms_norm(cfg.d, rngs)
        self.gate = dense(cfg.d, cfg.mlp, ("embed", "mlp"), rngs)
        self.up = dense(cfg.d, cfg.mlp, ("embed", "mlp"), rngs)
        self.down = dense(cfg.mlp, cfg.d, ("mlp", "embed"), rngs)

    def __call__(self, x, positions, mask, cache=None):
        cache, h = self.attn(self.attn_norm(x), positions, mask, cache)
        x = x + h
        h = self.mlp_norm(x)
        return cache, x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class LocalGlobal(nnx.Module):
    """One scanned layer (as Gemma 2 in MaxText): a sliding-window block, then a global one."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.local = Block(cfg, cfg.window, LOCAL_BASE, rngs)
        self.glob = Block(cfg, None, GLOBAL_BASE, rngs)

    def __call__(self, x, positions, mask, cache=None):
        c_local, c_glob = cache if cache is not None else (None, None)
        c_local, x = self.local(x, positions, mask, c_local)
        c_glob, x = self.glob(x, positions, mask, c_glob)
        return (None if cache is None else (c_local, c_glob)), x


class Transformer(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.stacked = cfg.stacked
        embed_init = nnx.with_partitioning(nnx.initializers.normal(1.0), ("vocab", "embed"))
        self.embedder = nnx.Embed(cfg.vocab, cfg.d, embedding_init=embed_init, rngs=rngs)
        if cfg.stacked:

            @nnx.split_rngs(splits=cfg.pairs)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make(rngs):
                return LocalGlobal(cfg, rngs)

            self.layers = make(rngs)
        else:  # the same interleaving as a list: even blocks sliding-window, odd ones global

            def local(i):
                return i % 2 == 0

            self.layers = nnx.List(
                [
                    Block(cfg, cfg.window if local(i) else None, LOCAL_BASE if local(i) else GLOBAL_BASE, rngs)
                    for i in range(2 * cfg.pairs)
                ]
            )
        self.final_norm = rms_norm(cfg.d, rngs)
        self.head = dense(cfg.d, cfg.vocab, ("embed", "vocab"), rngs)

    def __call__(self, tokens, positions, mask):
        x = self.embedder(tokens)
        if self.stacked:

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def forward(x, layer):
                return layer(x, positions, mask)[1]

            x = forward(x, self.layers)
        else:
            for block in self.layers:
                x = block(x, positions, mask)[1]
        return self.head(self.final_norm(x))


# -- the loss, the units, the plan ------------------------------------------------------------


def token_losses(logits, batch):
    """Per-token cross-entropy of the next token, zero at padding, and the padding mask."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["tokens"][:, 1:])
    real = batch["mask"].astype(jnp.float32)
    return ce * real, real


def model_loss(model, batch):
    """The single-device loss: the mean over all real tokens of the batch."""
    ce, real = token_losses(model(batch["tokens"][:, :-1], batch["pos"], batch["mask"]), batch)
    return ce.sum() / real.sum()


def head_loss(model, x, batch):
    ce, real = token_losses(model.head(model.final_norm(x)), batch)
    per_example = ce.sum(1) / jnp.maximum(real.sum(1), 1.0)
    return (ce.sum(), real.sum()), {"per_example": per_example, "real_tokens": real.sum()}


UNITS = Units(
    embed=lambda m, b: m.embedder(b["tokens"][:, :-1]),
    head_loss=head_loss,
    blocks="layers",
    block_call=lambda blk, x, b: blk(x, b["pos"], b["mask"])[1],
    stacked=True,
    has_aux=True,
    sum_and_count=True,
)
LIST_UNITS = dataclasses.replace(UNITS, stacked=False)
TP_NAMES = ("heads", "kv_heads", "mlp", "vocab")


def logical_rules(mesh) -> list:
    """Logical axes -> the mesh's axes (MaxText's logical_axis_rules): embed over fsdp, the rest over tp."""

    def has(a):
        return a if a in mesh.axis_names else None

    return [("embed", has("fsdp")), ("layers", None), *[(n, has("tp")) for n in TP_NAMES]]


def make_model(cfg: Config, mesh=None) -> Transformer:
    """As people create it: under the mesh, each parameter sharded by its annotation; or, for
    the single-device reference, with eager sharding off (the same values)."""
    if mesh is None:
        with nnx.use_eager_sharding(False):
            return Transformer(cfg, nnx.Rngs(0))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(logical_rules(mesh)):
        return Transformer(cfg, nnx.Rngs(0))


def annotated_plan(model: Transformer) -> tp_plan.TPPlan:
    return tp_plan.TPPlan.from_annotations(
        model,
        {n: "tp" for n in TP_NAMES},
        divide={"layers/*/attn": ("n_heads", "n_kv_heads")},
        overrides={"head": tp_plan.column(gather_output=True)},  # head_loss reads whole logits
    )


LENGTHS = [16, 3, 9, 16, 1, 12, 5, 14]  # real tokens per example: each rank holds a different count


def batches(n: int, seed: int = 0) -> list[dict]:
    """Left-padded sequences: positions count from each example's first real token."""
    rng = np.random.default_rng(seed)
    t = np.arange(16)[None]
    pad = 16 - np.asarray(LENGTHS)[:, None]
    out = []
    for _ in range(n):
        tokens = rng.integers(0, 64, (8, 17)).astype(np.int32)
        out.append({"tokens": tokens, "pos": (t - pad).astype(np.int32), "mask": t >= pad})
    return out
