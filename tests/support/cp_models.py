"""A small decoder written the way published ones are (Llama / Mistral style): rotary positions
read from the batch, grouped-query attention, a document mask over packed sequences built from
`batch["segment_ids"]`, an optional sliding window, RMSNorm and a SwiGLU MLP; and a plain
single-device training loop (jax.grad + optax) that strategies are compared against."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdist.engine.run import Units
from jaxdist.tp import plan as tp_plan


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    vocab: int = 64
    d_model: int = 32
    n_heads: int = 4
    n_kv_heads: int = 2
    n_layers: int = 2
    window: int | None = None  # sliding window: keys at most `window` positions back


def rope(x, positions, base: float = 10000.0):
    """Rotary embedding of x [B, T, heads, head_dim] at `positions` [B, T] (rotate-half form)."""
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None].astype(jnp.float32) * freq  # [B, T, half]
    cos, sin = jnp.cos(angle)[:, :, None], jnp.sin(angle)[:, :, None]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)


def _heads(a, n: int):
    return a.reshape(*a.shape[:-1], n, -1)


class DecoderBlock(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        d, hd = cfg.d_model, cfg.d_model // cfg.n_heads
        self.n_heads, self.n_kv_heads, self.window = cfg.n_heads, cfg.n_kv_heads, cfg.window
        self.norm1 = nnx.RMSNorm(d, rngs=rngs)
        self.q = nnx.Linear(d, cfg.n_heads * hd, use_bias=False, rngs=rngs)
        self.k = nnx.Linear(d, cfg.n_kv_heads * hd, use_bias=False, rngs=rngs)
        self.v = nnx.Linear(d, cfg.n_kv_heads * hd, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(cfg.n_heads * hd, d, use_bias=False, rngs=rngs)
        self.norm2 = nnx.RMSNorm(d, rngs=rngs)
        self.gate = nnx.Linear(d, 2 * d, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(d, 2 * d, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(2 * d, d, use_bias=False, rngs=rngs)

    def __call__(self, x, positions, segment_ids):
        h = self.norm1(x)
        q = rope(_heads(self.q(h), self.n_heads), positions)
        k = rope(_heads(self.k(h), self.n_kv_heads), positions)
        v = _heads(self.v(h), self.n_kv_heads)
        # packed documents: a token sees only tokens of its own document
        mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
        window = None if self.window is None else (self.window, 0)
        att = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, local_window_size=window)
        x = x + self.o(att.reshape(*att.shape[:-2], -1))
        h = self.norm2(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Decoder(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        self.embedding = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
        self.blocks = nnx.List([DecoderBlock(cfg, rngs) for _ in range(cfg.n_layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, rngs=rngs)


def decoder_embed(model: Decoder, batch):
    return model.embedding(batch["tokens"])


def decoder_block(block: DecoderBlock, x, batch):
    return block(x, batch["positions"], batch["segment_ids"])


def decoder_head_loss(model: Decoder, x, batch):
    logits = model.head(model.norm(x)).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


# Megatron's layout for the decoder: heads (query and the fewer key/value heads) and the MLP's hidden
# features split over tp
DECODER_TP_PLAN = tp_plan.TPPlan(
    layers={
        "blocks/*/q": tp_plan.column(),
        "blocks/*/k": tp_plan.column(),
        "blocks/*/v": tp_plan.column(),
        "blocks/*/o": tp_plan.row(),
        "blocks/*/gate": tp_plan.column(),
        "blocks/*/up": tp_plan.column(),
        "blocks/*/down": tp_plan.row(),
    },
    divide={"blocks/*": ("n_heads", "n_kv_heads")},
)

DECODER_UNITS = Units(embed=decoder_embed, head_loss=decoder_head_loss, block_call=decoder_block)


def units_loss(units: Units):
    """The whole model's loss as one function of (model, batch), from its units (for the reference)."""

    def loss(model, batch):
        x = units.embed(model, batch)
        for block in getattr(model, units.blocks):
            x = units.block_call(block, x, batch) if units.block_call else block(x)
        return units.head_loss(model, x, batch)

    return loss


def packed_batch(rows: int, length: int, vocab: int, seed: int, documents: int = 3) -> dict:
    """Rows of `documents` packed documents of random lengths: tokens, labels, per-document positions
    (restarting at 0 in each document) and document ids."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (rows, length + 1)).astype(np.int32)
    seg = np.zeros((rows, length), np.int32)
    pos = np.zeros((rows, length), np.int32)
    for r in range(rows):
        cuts = np.sort(rng.choice(np.arange(1, length), documents - 1, replace=False))
        starts = np.concatenate([[0], cuts])
        for d, s in enumerate(starts):
            seg[r, s:] = d
        pos[r] = np.arange(length) - starts[seg[r]]
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "positions": pos, "segment_ids": seg}


def reference_run(model, optimizer, loss_fn, batches) -> tuple[list, list, dict]:
    """The single-device training run: per step the loss and global gradient norm, then the final
    parameters (a pure dict), from jax.grad and optax alone."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), batch))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    losses, norms = [], []
    for batch in batches:
        params, opt_state, loss, norm = step(params, opt_state, batch)
        losses.append(float(loss))
        norms.append(float(norm))
    return losses, norms, nnx.to_pure_dict(params)
