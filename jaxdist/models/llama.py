"""A Llama-style decoder in plain Flax NNX (Llama 3, Qwen 2 / 3, Mistral): RMSNorm, rotary embeddings
in Hugging Face's layout (with Llama 3's frequency scaling), grouped-query attention (optional q/k
norms, q/k/v biases, a sliding window), a SwiGLU MLP and an optionally tied head.

Parameter names and shapes follow one convention that the Hugging Face mapping reads: `embed`
(vocab, d); per block `attn_norm.scale`, `attn.{q,k,v,o}.kernel` (in, out) with `attn.{q,k,v}.bias`
only with `qkv_bias`, `attn.{q,k}_norm.scale` (head_dim) with `qk_norm`, `mlp_norm.scale`,
`mlp.{gate,up,down}.kernel`; `final_norm.scale`; `head.kernel` (d, vocab) unless tied. The units,
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
from jaxdist.models.layers import INIT_STD, Attention, GatedMLP, RMSNorm, dense, rope_frequencies

__all__ = [
    "LlamaConfig",
    "Llama",
    "LlamaBlock",
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
class LlamaConfig:
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    d_ff: int = 128
    rope_theta: float = 10000.0
    # None, or Hugging Face's Llama 3 rope_scaling: factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings (a rope_type key, "llama3", may come along)
    rope_scaling: dict | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qk_norm: bool = False  # Qwen 3: RMSNorm over head_dim on each query and key head, before the rotation
    qkv_bias: bool = False  # Qwen 2: biases on q, k and v
    seq_len: int = 2048  # the training length (and the KV cache's)
    sliding_window: int | None = None  # Mistral: each token sees itself and the window - 1 before it
    dtype: Any = jnp.float32  # compute dtype
    param_dtype: Any = jnp.float32
    # jax.nn.dot_product_attention's implementation: None (XLA's choice), "xla" or "cudnn"
    attention: str | None = None

    def __post_init__(self):
        check_config(self)

    def num_params(self) -> int:
        d, hd, f = self.d_model, self.head_dim, self.d_ff
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0) + (2 * hd if self.qk_norm else 0)
        block = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.n_layers * block + d + head

    def flops_per_token(self) -> float:
        """6 N (matmuls, forward and backward) + 12 L (heads x head_dim) T (attention scores and values)."""
        return 6 * self.num_params() + 12 * self.n_layers * self.n_heads * self.head_dim * self.seq_len


def _llama3(factor: float, original: int) -> dict:
    return {
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original,
        "rope_type": "llama3",
    }


# Named sizes: CPU demos, then released shapes (their config.json values; num_params() is checked
# against the published counts in tests/models/test_param_counts.py). Released flavors train on
# seq_len=2048 tokens; model.seq_len overrides it.
FLAVORS = {
    # GQA and q/k norms, so the CPU tests and demos run both
    "tiny": LlamaConfig(
        vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128, qk_norm=True, seq_len=64
    ),
    "small-cpu": LlamaConfig(
        vocab_size=256, d_model=128, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=16, d_ff=384, seq_len=128
    ),
    # Llama 3.2 1B
    "llama3-1b": LlamaConfig(
        vocab_size=128256,
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        head_dim=64,
        d_ff=8192,
        rope_theta=500000.0,
        rope_scaling=_llama3(32.0, 8192),
        tie_embeddings=True,
    ),
    # Llama 3.1 8B
    "llama3-8b": LlamaConfig(
        vocab_size=128256,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        d_ff=14336,
        rope_theta=500000.0,
        rope_scaling=_llama3(8.0, 8192),
    ),
    "qwen2.5-0.5b": LlamaConfig(
        vocab_size=151936,
        d_model=896,
        n_layers=24,
        n_heads=14,
        n_kv_heads=2,
        head_dim=64,
        d_ff=4864,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        tie_embeddings=True,
        qkv_bias=True,
    ),
    "qwen3-0.6b": LlamaConfig(
        vocab_size=151936,
        d_model=1024,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,
        d_ff=3072,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        tie_embeddings=True,
        qk_norm=True,
    ),
    "qwen3-8b": LlamaConfig(
        vocab_size=151936,
        d_model=4096,
        n_layers=36,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        d_ff=12288,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qk_norm=True,
    ),
    # Mistral 7B v0.1 (its 4096-token sliding window)
    "mistral-7b": LlamaConfig(
        vocab_size=32000,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        d_ff=14336,
        rope_theta=10000.0,
        sliding_window=4096,
    ),
}


class LlamaBlock(nnx.Module):
    """Pre-norm block: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x))."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        d, kw = cfg.d_model, dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)

        def head_norm() -> RMSNorm:
            return RMSNorm(cfg.head_dim, cfg.norm_eps, **kw)

        self.attn_norm = RMSNorm(d, cfg.norm_eps, **kw)
        self.attn = Attention(
            d,
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.head_dim,
            qkv_bias=cfg.qkv_bias,
            qk_norm=head_norm if cfg.qk_norm else None,
            scale=cfg.head_dim**-0.5,
            inv_freq=rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
            window=cfg.sliding_window,
            softcap=None,
            implementation=cfg.attention,
            rngs=rngs,
            **kw,
        )
        self.mlp_norm = RMSNorm(d, cfg.norm_eps, **kw)
        self.mlp = GatedMLP(d, cfg.d_ff, "silu", rngs=rngs, **kw)

    def __call__(self, x: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None):
        x = x + self.attn(self.attn_norm(x), positions, segment_ids)
        return x + self.mlp(self.mlp_norm(x))

    def decode(self, x: jax.Array, cache: jax.Array, pos: jax.Array) -> tuple[jax.Array, jax.Array]:
        att, cache = self.attn.decode(self.attn_norm(x), cache, pos)
        x = x + att
        return x + self.mlp(self.mlp_norm(x)), cache


class Llama(decoder.Decoder):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        init = nnx.initializers.normal(INIT_STD)
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, rngs=rngs, **kw)
        self.blocks = nnx.List([LlamaBlock(cfg, rngs) for _ in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, **kw)
        self.head = None if cfg.tie_embeddings else dense(cfg.d_model, cfg.vocab_size, bias=False, rngs=rngs, **kw)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        return self.embed(tokens)

    def logits(self, x: jax.Array) -> jax.Array:
        x = self.final_norm(x)
        return self.embed.attend(x) if self.head is None else self.head(x)


def tp_plan_for(cfg: LlamaConfig):
    """The TP plan (jaxdist.models.decoder.tp_plan_for): without a head rule when the head is tied."""
    return decoder.tp_plan_for(cfg, tied=cfg.tie_embeddings)


def check_tp(cfg: LlamaConfig, tp: int) -> None:
    """Raise a one-line ValueError when `cfg` cannot split over `tp` ranks (n_kv_heads, n_heads, d_ff, vocab)."""
    decoder.check_tp(cfg, tp)
