"""The layers the rotary decoder families (Llama-style, Gemma-style) share: RMS norms, rotary
embeddings in Hugging Face's layout, grouped-query attention with a KV cache, a gated MLP.

Every layer derives its sizes from its arrays and from attributes a TP plan may divide
(`n_heads`, `n_kv_heads`), so the same code runs whole on one device, on one tensor-parallel
rank's heads, and on a sequence-parallel chunk of the tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

INIT_STD = 0.02  # Hugging Face's initializer_range for these families


def dense(n_in: int, n_out: int, *, bias: bool, dtype, param_dtype, rngs: nnx.Rngs) -> nnx.Linear:
    init = nnx.initializers.normal(INIT_STD)
    return nnx.Linear(n_in, n_out, use_bias=bias, kernel_init=init, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


class RMSNorm(nnx.Module):
    """y = x * rsqrt(mean(x^2) + eps) * scale in float32, cast to the compute dtype. With `plus_one`
    (Gemma) the gain is (1 + scale) and `scale` starts at zeros, as Hugging Face stores Gemma's `weight`."""

    def __init__(self, dim: int, eps: float, *, plus_one: bool = False, dtype=None, param_dtype=jnp.float32):
        init = jnp.zeros if plus_one else jnp.ones
        self.scale = nnx.Param(init((dim,), param_dtype))
        self.eps, self.plus_one, self.dtype = eps, plus_one, dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        y = y * (1.0 + scale if self.plus_one else scale)
        return y.astype(self.dtype or x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: Mapping | None = None) -> tuple[float, ...]:
    """The rotary inverse frequencies theta^(-2i/head_dim), i < head_dim / 2, as float32 values (as
    Hugging Face computes them); with `scaling` (Llama 3's "llama3" rope_scaling: factor,
    low_freq_factor, high_freq_factor, original_max_position_embeddings) long wavelengths are
    divided by `factor` and the band between the two cut-offs is interpolated; "linear" scaling
    (Gemma 3 4B and larger) divides every frequency by `factor` (positions interpolated)."""
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    inv = (1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim)).astype(np.float32)
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type", "llama3"))
    if kind == "linear":
        factor = float(scaling["factor"])
        if not factor > 0:
            raise ValueError(f"linear rope_scaling needs a factor > 0, got {scaling['factor']!r}")
        return tuple(float(f) for f in (inv / np.float32(factor)).astype(np.float32))
    if kind not in (None, "default"):
        if kind != "llama3":
            raise ValueError(
                f"rope_scaling of type {kind!r} is not supported; give Llama 3's 'llama3', 'linear' or None"
            )
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return tuple(float(f) for f in inv)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: tuple[float, ...]) -> jax.Array:
    """Rotate `x` [batch, tokens, heads, head_dim] by its `positions` [batch or 1, tokens], in Hugging
    Face's layout: the first half of head_dim pairs with the second half (rotate_half)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    first, second = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-second, first], axis=-1) * sin


def visible(q_pos: jax.Array, k_pos: jax.Array, window: int | None) -> jax.Array:
    """Which keys each query sees: causal (k <= q) and, with a sliding `window`, q - k < window."""
    diff = q_pos[..., :, None] - k_pos[..., None, :]
    seen = diff >= 0
    return seen & (diff < window) if window is not None else seen


def same_segment(segment_ids: jax.Array) -> jax.Array:
    """[batch, 1, tokens, tokens]: tokens of one packed document see each other; padding (segment id 0)
    sees only padding, so no real token ever reads it."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def _softcapped_attention(q, k, v, mask, scale: float, cap: float):
    """Attention with Gemma 2's logit soft-capping tanh(l / cap) * cap, which jax.nn's kernel lacks."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, n // kv, h)
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    logits = jnp.tanh(logits / cap) * cap
    logits = jnp.where(mask[:, :, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(b, t, n, h)


class Attention(nnx.Module):
    """Causal grouped-query self-attention with rotary embeddings: projections `q` (d -> n_heads *
    head_dim), `k`, `v` (d -> n_kv_heads * head_dim), `o` (back to d); optional per-head `q_norm`
    and `k_norm` (made by `qk_norm()`, over head_dim) before the rotation; each kv head serves
    n_heads / n_kv_heads query heads."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool,
        qk_norm: Callable[[], RMSNorm] | None,
        scale: float,
        inv_freq: tuple[float, ...],
        window: int | None,
        softcap: float | None,
        implementation: str | None,
        dtype,
        param_dtype,
        rngs: nnx.Rngs,
    ):
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q = dense(d_model, n_heads * head_dim, bias=qkv_bias, **kw)
        self.k = dense(d_model, n_kv_heads * head_dim, bias=qkv_bias, **kw)
        self.v = dense(d_model, n_kv_heads * head_dim, bias=qkv_bias, **kw)
        self.o = dense(n_heads * head_dim, d_model, bias=False, **kw)
        if qk_norm is not None:
            self.q_norm, self.k_norm = qk_norm(), qk_norm()
        else:
            self.q_norm = self.k_norm = None
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.scale, self.inv_freq, self.window, self.softcap = scale, inv_freq, window, softcap
        self.implementation = implementation

    def __call__(self, x: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None):
        """`x` [batch, tokens, d]; `positions` and `segment_ids` [batch, tokens] for packed documents
        (default: positions 0, 1, ... and one document)."""
        q, k, v = self._project(x, positions)
        if segment_ids is None and self.softcap is None:
            window = (self.window - 1, 0) if self.window is not None else None
            out = jax.nn.dot_product_attention(
                q, k, v, scale=self.scale, is_causal=True, local_window_size=window, implementation=self.implementation
            )
        else:
            idx = jnp.arange(q.shape[1])
            mask = visible(idx, idx, self.window)[None, None]
            if segment_ids is not None:
                mask = mask & same_segment(segment_ids)
            out = self._attend(q, k, v, mask)
        return self.o(out.reshape(*out.shape[:-2], -1))

    def decode(self, x: jax.Array, cache: jax.Array, pos: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`__call__` for the tokens at positions pos, pos + 1, ... given the keys and values of the earlier
        ones in `cache` ([2, batch, cache length, n_kv_heads, head_dim]); returns (out, updated cache)."""
        positions = pos + jnp.arange(x.shape[1])[None]
        q, k, v = self._project(x, positions)
        start = (0, pos, 0, 0)
        keys = jax.lax.dynamic_update_slice(cache[0], k.astype(cache.dtype), start)
        values = jax.lax.dynamic_update_slice(cache[1], v.astype(cache.dtype), start)
        mask = visible(positions[0], jnp.arange(keys.shape[1]), self.window)[None, None]
        out = self._attend(q, keys.astype(q.dtype), values.astype(q.dtype), mask)
        return self.o(out.reshape(*out.shape[:-2], -1)), jnp.stack([keys, values])

    def _project(self, x, positions):
        q, k, v = self.q(x), self.k(x), self.v(x)
        # heads from the arrays and the (tp-divided) head counts: under sequence parallelism the
        # projections' outputs hold all the tokens while `x` holds a chunk
        q = q.reshape(*q.shape[:-1], self.n_heads, q.shape[-1] // self.n_heads)
        k = k.reshape(*k.shape[:-1], self.n_kv_heads, k.shape[-1] // self.n_kv_heads)
        v = v.reshape(*v.shape[:-1], self.n_kv_heads, v.shape[-1] // self.n_kv_heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if positions is None:
            positions = jnp.arange(q.shape[1])[None]
        return apply_rope(q, positions, self.inv_freq), apply_rope(k, positions, self.inv_freq), v

    def _attend(self, q, k, v, mask):
        if self.softcap is not None:
            return _softcapped_attention(q, k, v, mask, self.scale, self.softcap)
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=self.scale, implementation=self.implementation)


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU's tanh approximation (Hugging Face's gelu_pytorch_tanh)."""
    return jax.nn.gelu(x, approximate=True)


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": gelu_tanh}


class GatedMLP(nnx.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with act="silu" (Llama), GeGLU with "gelu_tanh" (Gemma)."""

    def __init__(self, d_model: int, d_ff: int, activation: str, *, dtype, param_dtype, rngs: nnx.Rngs):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        kw = dict(bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate, self.up, self.down = (
            dense(d_model, d_ff, **kw),
            dense(d_model, d_ff, **kw),
            dense(d_ff, d_model, **kw),
        )
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(ACTIVATIONS[self.activation](self.gate(x)) * self.up(x))
