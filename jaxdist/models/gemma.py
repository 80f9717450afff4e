"""A Gemma-style decoder in plain Flax NNX (Gemma 3): local sliding-window layers interleaved with global
ones (each with its own rotary base), q/k norms, norms before and after attention and MLP, a GeGLU MLP,
an embedding scaled by sqrt(d_model) and tied to the head, optional logit soft-capping (Gemma 2).

Parameter names and shapes, as the Hugging Face mapping reads them: `embed` (vocab, d); per block
`attn_norm`, `post_attn_norm`, `mlp_norm`, `post_mlp_norm` (each `.scale`, stored as Hugging Face
stores Gemma's norm `weight`: the gain is 1 + scale), `attn.{q,k,v,o}.kernel` (in, out),
`attn.{q,k}_norm.scale` (head_dim), `mlp.{gate,up,down}.kernel`; `final_norm.scale`. The units,
the TP plan and decoding are the decoders' shared ones (jaxdist.models.decoder).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist.models import decoder
from jaxdist.models.decoder import PACKED_UNITS, UNITS, check_config, embed_inputs, head_loss, next_token_loss
from jaxdist.models.layers import INIT_STD, Attention, GatedMLP, RMSNorm, rope_frequencies

__all__ = [
    "GemmaConfig",
    "Gemma",
    "GemmaBlock",
    "FLAVORS",
    "UNITS",
    "PACKED_UNITS",
    "embed_inputs",
    "head_loss",
    "next_token_loss",
    "tp_plan_for",
    "check_tp",
]


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    d_ff: int = 128
    rope_theta_local: float = 10000.0  # the rotary base of sliding-window layers
    rope_theta_global: float = 1000000.0  # and of global layers
    # global layers' positions divided by this (linear RoPE scaling; Gemma 3 4B and larger: 8.0)
    rope_scale_global: float = 1.0
    sliding_window: int | None = 512  # local layers: each token sees itself and the window - 1 before it
    global_every: int = 6  # layer i is global when (i + 1) % global_every == 0 (Gemma 3: 5 local, 1 global)
    query_pre_attn_scalar: float = 256.0  # attention scale: query_pre_attn_scalar ** -0.5
    attn_softcap: float | None = None  # Gemma 2: attention logits soft-capped to tanh(l / c) * c
    final_softcap: float | None = None  # Gemma 2: the same on the output logits
    norm_eps: float = 1e-6
    seq_len: int = 2048  # the training length (and the KV cache's)
    dtype: Any = jnp.float32  # compute dtype
    param_dtype: Any = jnp.float32
    # jax.nn.dot_product_attention's implementation: None (XLA's choice), "xla" or "cudnn"
    attention: str | None = None

    def __post_init__(self):
        check_config(self)
        if not isinstance(self.global_every, int) or self.global_every < 1:
            raise ValueError(f"GemmaConfig.global_every must be a positive int, got {self.global_every!r}")
        if not (isinstance(self.rope_scale_global, int | float) and self.rope_scale_global > 0):
            raise ValueError(f"GemmaConfig.rope_scale_global must be a number > 0, got {self.rope_scale_global!r}")
        for name in ("attn_softcap", "final_softcap"):
            cap = getattr(self, name)
            if cap is not None and not cap > 0:
                raise ValueError(f"GemmaConfig.{name} must be None or > 0, got {cap!r}")

    def is_global(self, layer: int) -> bool:
        """Whether layer `layer` attends to the whole context (else to the sliding window)."""
        return self.sliding_window is None or (layer + 1) % self.global_every == 0

    def num_params(self) -> int:
        d, hd, f = self.d_model, self.head_dim, self.d_ff
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        block = d * q + 2 * d * kv + q * d + 2 * hd + 3 * d * f + 4 * d
        return self.vocab_size * d + self.n_layers * block + d  # the head is the embedding

    def flops_per_token(self) -> float:
        """6 N (matmuls, forward and backward) + 12 L (heads x head_dim) T (attention scores and values;
        the sliding window's saving not counted)."""
        return 6 * self.num_params() + 12 * self.n_layers * self.n_heads * self.head_dim * self.seq_len


# Named sizes: CPU demos, then released shapes (config.json values; num_params() checked against
# the published count in tests/models/test_param_counts.py). gemma3-1b trains on seq_len=2048 tokens.
FLAVORS = {
    # local and global layers alternate, so the CPU tests and demos run both
    "tiny": GemmaConfig(
        vocab_size=256,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        d_ff=128,
        sliding_window=16,
        global_every=2,
        query_pre_attn_scalar=16.0,
        seq_len=64,
    ),
    "small-cpu": GemmaConfig(
        vocab_size=256,
        d_model=128,
        n_layers=6,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        d_ff=512,
        sliding_window=32,
        global_every=3,
        query_pre_attn_scalar=32.0,
        seq_len=128,
    ),
    # Gemma 3 1B
    "gemma3-1b": GemmaConfig(
        vocab_size=262144,
        d_model=1152,
        n_layers=26,
        n_heads=4,
        n_kv_heads=1,
        head_dim=256,
        d_ff=6912,
        sliding_window=512,
        global_every=6,
        query_pre_attn_scalar=256.0,
    ),
    # Gemma 3 4B's language model (its vision tower not counted)
    "gemma3-4b": GemmaConfig(
        vocab_size=262208,
        d_model=2560,
        n_layers=34,
        n_heads=8,
        n_kv_heads=4,
        head_dim=256,
        d_ff=10240,
        sliding_window=1024,
        global_every=6,
        rope_scale_global=8.0,
        query_pre_attn_scalar=256.0,
    ),
}


class GemmaBlock(nnx.Module):
    """x + post_attn_norm(attn(attn_norm(x))), then x + post_mlp_norm(mlp(mlp_norm(x))); global layers
    attend to everything before, local ones to a sliding window, each with its own rotary base."""

    def __init__(self, cfg: GemmaConfig, layer: int, rngs: nnx.Rngs):
        d, kw = cfg.d_model, dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)

        def norm(dim: int = d) -> RMSNorm:
            return RMSNorm(dim, cfg.norm_eps, plus_one=True, **kw)

        def head_norm() -> RMSNorm:
            return norm(cfg.head_dim)

        is_global = cfg.is_global(layer)
        theta = cfg.rope_theta_global if is_global else cfg.rope_theta_local
        scale = cfg.rope_scale_global if is_global else 1.0
        scaling = {"rope_type": "linear", "factor": scale} if scale != 1.0 else None
        self.attn_norm, self.post_attn_norm = norm(), norm()
        self.attn = Attention(
            d,
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.head_dim,
            qkv_bias=False,
            qk_norm=head_norm,
            scale=cfg.query_pre_attn_scalar**-0.5,
            inv_freq=rope_frequencies(cfg.head_dim, theta, scaling),
            window=None if is_global else cfg.sliding_window,
            softcap=cfg.attn_softcap,
            implementation=cfg.attention,
            rngs=rngs,
            **kw,
        )
        self.mlp_norm, self.post_mlp_norm = norm(), norm()
        self.mlp = GatedMLP(d, cfg.d_ff, "gelu_tanh", rngs=rngs, **kw)

    def __call__(self, x: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None):
        x = x + self.post_attn_norm(self.attn(self.attn_norm(x), positions, segment_ids))
        return x + self.post_mlp_norm(self.mlp(self.mlp_norm(x)))

    def decode(self, x: jax.Array, cache: jax.Array, pos: jax.Array) -> tuple[jax.Array, jax.Array]:
        att, cache = self.attn.decode(self.attn_norm(x), cache, pos)
        x = x + self.post_attn_norm(att)
        return x + self.post_mlp_norm(self.mlp(self.mlp_norm(x))), cache


class Gemma(decoder.Decoder):
    def __init__(self, cfg: GemmaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        init = nnx.initializers.normal(INIT_STD)
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, rngs=rngs, **kw)
        self.blocks = nnx.List([GemmaBlock(cfg, i, rngs) for i in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, plus_one=True, **kw)
        self.final_softcap = cfg.final_softcap

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        return x * jnp.asarray(self.cfg.d_model**0.5, x.dtype)  # the scale rounded to the compute dtype

    def logits(self, x: jax.Array) -> jax.Array:
        logits = self.embed.attend(self.final_norm(x))
        if self.final_softcap is not None:
            logits = jnp.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def tp_plan_for(cfg: GemmaConfig):
    """The TP plan (jaxdist.models.decoder.tp_plan_for) of the tied head; with `final_softcap` the logits
    are gathered, as the soft-capping reads them whole."""
    return decoder.tp_plan_for(cfg, tied=True, gather_logits=cfg.final_softcap is not None)


def check_tp(cfg: GemmaConfig, tp: int) -> None:
    """Raise a one-line ValueError when `cfg` cannot split over `tp` ranks (n_kv_heads, n_heads, d_ff, vocab)."""
    decoder.check_tp(cfg, tp)
