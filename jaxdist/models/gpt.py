"""A GPT in plain Flax NNX: embeddings, a list of identical blocks, a head.

The model knows nothing about parallelism; jaxdist's strategies wrap it from
outside. The three parts are separate methods (`embed`, `blocks`, `logits`)
so a strategy that works unit by unit (FSDP) can call them one at a time.
`decode` runs the same blocks a chunk of positions at a time against a cache of
keys and values, for generation (jaxdist.train.sample).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist.engine.run import Units
from jaxdist.tp import plan as tp_plan


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int | None = None  # default 4 * d_model
    tie_embeddings: bool = False
    dtype: Any = jnp.float32  # compute dtype
    param_dtype: Any = jnp.float32
    # jax.nn.dot_product_attention's implementation: None (XLA's choice), "xla" or "cudnn"
    # (flash attention on NVIDIA GPUs; needs bfloat16/float16)
    attention: str | None = None
    # head_loss's cross-entropy this many tokens at a time, each chunk's logits recomputed in backward:
    # the float32 logits of the whole batch ([batch, seq_len, vocab]) never exist (None: all at once)
    loss_chunk: int | None = None

    @property
    def ff(self) -> int:
        return self.d_ff or 4 * self.d_model

    def num_params(self) -> int:
        d, f, v = self.d_model, self.ff, self.vocab_size
        block = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d
        head = 0 if self.tie_embeddings else d * v
        return v * d + self.seq_len * d + self.n_layers * block + 2 * d + head


# Named sizes, from a CPU demo up to about 1B parameters (GPT-2 / GPT-3 shapes).
FLAVORS = {
    "tiny": GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_heads=4, n_layers=2),
    "small-cpu": GPTConfig(vocab_size=256, seq_len=128, d_model=128, n_heads=4, n_layers=4),
    "124m": GPTConfig(vocab_size=50304, seq_len=1024, d_model=768, n_heads=12, n_layers=12, tie_embeddings=True),
    "350m": GPTConfig(vocab_size=50304, seq_len=1024, d_model=1024, n_heads=16, n_layers=24, tie_embeddings=True),
    "760m": GPTConfig(vocab_size=50304, seq_len=1024, d_model=1536, n_heads=16, n_layers=24, tie_embeddings=True),
    "1.3b": GPTConfig(vocab_size=50304, seq_len=1024, d_model=2048, n_heads=32, n_layers=24, tie_embeddings=True),
}


def _dense(cfg: GPTConfig, n_in: int, n_out: int, rngs: nnx.Rngs, scale: float = 1.0) -> nnx.Linear:
    init = nnx.initializers.normal(0.02 * scale)
    return nnx.Linear(n_in, n_out, kernel_init=init, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)


class Block(nnx.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.dtype = cfg.dtype
        self.attention = cfg.attention
        proj_scale = (2 * cfg.n_layers) ** -0.5  # GPT-2's scaled init of the residual projections
        self.ln1 = nnx.LayerNorm(d, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.qkv = _dense(cfg, d, 3 * d, rngs)
        self.proj = _dense(cfg, d, d, rngs, proj_scale)
        self.ln2 = nnx.LayerNorm(d, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.fc = _dense(cfg, d, cfg.ff, rngs)
        self.out = _dense(cfg, cfg.ff, d, rngs, proj_scale)

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = self._heads(x)
        att = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.attention)
        return self._after_attention(x, att)

    def decode(self, x: jax.Array, cache: jax.Array, pos: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`__call__` for the tokens at positions pos, pos + 1, ... given the keys and values of the
        earlier ones in `cache` ([2, batch, seq_len, heads, head_dim]); returns (x, updated cache)."""
        q, k, v = self._heads(x)
        start = (0, pos, 0, 0)
        keys = jax.lax.dynamic_update_slice(cache[0], k.astype(cache.dtype), start)
        values = jax.lax.dynamic_update_slice(cache[1], v.astype(cache.dtype), start)
        causal = jnp.arange(keys.shape[1])[None, :] <= pos + jnp.arange(x.shape[1])[:, None]
        att = jax.nn.dot_product_attention(q, keys.astype(q.dtype), values.astype(q.dtype), mask=causal[None, None])
        return self._after_attention(x, att), jnp.stack([keys, values])

    def _heads(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
        # sizes from the arrays and `n_heads`, so the block also runs on one tensor-parallel
        # rank's heads (the TP plan divides n_heads) and on a sequence-parallel chunk
        return tuple(a.reshape(*a.shape[:-1], self.n_heads, a.shape[-1] // self.n_heads) for a in (q, k, v))

    def _after_attention(self, x: jax.Array, att: jax.Array) -> jax.Array:
        x = x + self.proj(att.reshape(*att.shape[:-2], -1))
        return x + self.out(jax.nn.gelu(self.fc(self.ln2(x))))


class GPT(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        init = nnx.initializers.normal(0.02)
        kw = dict(embedding_init=init, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.wte = nnx.Embed(cfg.vocab_size, cfg.d_model, **kw)
        self.wpe = nnx.Embed(cfg.seq_len, cfg.d_model, **kw)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.head = None if cfg.tie_embeddings else _dense(cfg, cfg.d_model, cfg.vocab_size, rngs)

    def embed(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """Token plus position embeddings; `positions` ([batch, tokens]) default to 0, 1, ..."""
        if positions is None:
            return self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))[None]
        return self.wte(tokens) + self.wpe(positions)

    def logits(self, x: jax.Array) -> jax.Array:
        x = self.ln_f(x)
        if self.head is None:
            return self.wte.attend(x)
        return self.head(x)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.logits(x)

    def empty_cache(self, batch: int) -> jax.Array:
        """Keys and values for `decode`: [n_layers, 2, batch, seq_len, heads, head_dim] zeros."""
        c = self.cfg
        return jnp.zeros((c.n_layers, 2, batch, c.seq_len, c.n_heads, c.d_model // c.n_heads), c.dtype)

    def decode(self, tokens: jax.Array, cache: jax.Array, pos: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Logits of `tokens` placed at positions pos, pos + 1, ... after those cached: the same
        values as `__call__` on the whole sequence (tests/train/test_sample.py), one chunk at a time."""
        x = self.wte(tokens) + self.wpe(pos + jnp.arange(tokens.shape[1]))[None]
        layers = []
        for block, layer in zip(self.blocks, cache, strict=True):
            x, layer = block.decode(x, layer, pos)
            layers.append(layer)
        return self.logits(x), jnp.stack(layers)


def embed_inputs(model: GPT, batch: dict) -> jax.Array:
    """The first unit: embeddings of every token but the last (of `batch["tokens"]` itself when the batch
    has `labels`: `next_token_batch`), at `batch["positions"]` when given."""
    tokens = batch["tokens"] if "labels" in batch else batch["tokens"][:, :-1]
    return model.embed(tokens, batch.get("positions"))


def head_loss(model: GPT, x: jax.Array, batch: dict) -> jax.Array:
    """The last unit: mean cross-entropy of predicting `batch["tokens"][:, 1:]` (or `batch["labels"]`:
    `next_token_batch`), float32 math, in chunks of `cfg.loss_chunk` tokens where set."""
    labels = batch["labels"] if "labels" in batch else batch["tokens"][:, 1:]
    chunk = getattr(getattr(model, "cfg", None), "loss_chunk", None)
    if chunk is not None:
        return chunked_cross_entropy(model.logits, x, labels, chunk)
    # tp_plan.cross_entropy: optax's on one device; under the TP plan each rank's vocabulary slice
    return tp_plan.cross_entropy(model.logits(x), labels).mean()


def chunked_cross_entropy(logits_fn, x: jax.Array, labels: jax.Array, chunk: int) -> jax.Array:
    """The mean cross-entropy of `logits_fn(x)` against `labels`, `chunk` tokens at a time.

    A scan over chunks of the flattened tokens (the last one padded and masked) whose body is
    rematerialized: backward keeps each chunk's input, not its logits, so at most one chunk's
    float32 logits are live, forward and backward.
    """
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"GPT: loss_chunk must be a positive int (tokens per chunk) or None, got {chunk!r}")
    n = labels.size
    pad = -n % chunk
    xs = jnp.pad(x.reshape(n, x.shape[-1]), ((0, pad), (0, 0))).reshape(-1, chunk, x.shape[-1])
    ys = jnp.pad(labels.reshape(n), (0, pad)).reshape(-1, chunk)
    real = (jnp.arange(n + pad) < n).reshape(-1, chunk)

    @jax.checkpoint
    def chunk_sum(x, y, keep):
        return jnp.sum(jnp.where(keep, tp_plan.cross_entropy(logits_fn(x), y), 0.0))

    def add(total, piece):
        return total + chunk_sum(*piece), None

    total, _ = jax.lax.scan(add, jnp.zeros((), jnp.float32), (xs, ys, real))
    return total / n


def next_token_batch(batch: dict) -> dict:
    """`{"tokens": [B, T + 1]}` as inputs and targets of one length, `{"tokens": [B, T], "labels": [B, T]}`:
    the layout context parallelism cuts along the sequence (the units read both layouts alike)."""
    tokens = batch["tokens"]
    return {**batch, "tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def next_token_loss(model: GPT, batch: dict) -> jax.Array:
    """The whole model's loss: `head_loss` after the blocks after `embed_inputs`."""
    x = embed_inputs(model, batch)
    for block in model.blocks:
        x = block(x)
    return head_loss(model, x, batch)


# How the GPT splits over a tensor-parallel axis (Megatron's layout): q/k/v by heads (one column
# split per part of the fused projection), the attention and MLP outputs by rows, the MLP input
# by columns, the vocabulary of the embedding and of the tied or separate head (its logits stay
# split: `head_loss` takes the loss with `tp_plan.cross_entropy`, so only per-token scalars cross
# tp); norms, row biases and positions replicated.
TP_PLAN = tp_plan.TPPlan(
    layers={
        "wte": tp_plan.vocab(loss_parallel=True),
        "blocks/*/qkv": tp_plan.column(groups=3),
        "blocks/*/proj": tp_plan.row(),
        "blocks/*/fc": tp_plan.column(),
        "blocks/*/out": tp_plan.row(),
        "head": tp_plan.column(loss_parallel=True),
    },
    divide={"blocks/*": ("n_heads",)},
)

# The GPT as units: embeddings, each block, then final norm, head and loss.
UNITS = Units(embed=embed_inputs, head_loss=head_loss, blocks="blocks")


def tp_plan_for(cfg: GPTConfig) -> tp_plan.TPPlan:
    """`TP_PLAN` without the head rule when the head is tied to the embedding."""
    if cfg.tie_embeddings:
        return dataclasses.replace(TP_PLAN, layers={k: v for k, v in TP_PLAN.layers.items() if k != "head"})
    return TP_PLAN
