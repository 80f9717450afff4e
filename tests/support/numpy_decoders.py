"""Float64 NumPy forwards of the Llama-style and Gemma-style decoders, written from their architecture
descriptions (docs/models.md and the published model cards), not from jaxdist's code: one loop per
sequence and per head, the rotation written as a rotation of the pairs (i, i + head_dim / 2).

They read parameters by the names the Hugging Face mapping uses (`embed/embedding`,
`blocks/<i>/attn/q/kernel`, ...), from the pure dict of the model's `nnx.Param` state.
"""

import math

import numpy as np


def _rms(x, scale, eps, plus_one=False):
    gain = 1.0 + scale if plus_one else scale
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> np.ndarray:
    """Rotary frequencies theta^(-2i / head_dim); Llama 3's rule: a frequency whose wavelength is shorter
    than original / high_freq_factor stays, longer than original / low_freq_factor is divided by factor,
    between them it is interpolated by s = (original / wavelength - low) / (high - low)."""
    freqs = theta ** (-2.0 * np.arange(head_dim // 2) / head_dim)
    if scaling is None:
        return freqs
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelength = 2 * math.pi / f
        if wavelength < original / high:
            out.append(f)
        elif wavelength > original / low:
            out.append(f / factor)
        else:
            s = (original / wavelength - low) / (high - low)
            out.append((1 - s) * f / factor + s * f)
    return np.asarray(out)


def _rotate(x, positions, freqs):
    """x [T, D]: each pair (x_i, x_{i + D/2}) rotated by the angle position * freq_i."""
    half = x.shape[-1] // 2
    angle = positions[:, None] * freqs[None, :]
    a, b = x[:, :half], x[:, half:]
    return np.concatenate([a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)], axis=-1)


def _attention(x, p, *, n_heads, n_kv, head_dim, scale, freqs, window, softcap, positions, segments, eps, gemma):
    """One sequence x [T, d]: causal grouped-query attention; query head h reads kv head h // (n_heads / n_kv)."""
    t = x.shape[0]
    q = x @ p["q"]["kernel"] + p["q"].get("bias", 0.0)
    k = x @ p["k"]["kernel"] + p["k"].get("bias", 0.0)
    v = x @ p["v"]["kernel"] + p["v"].get("bias", 0.0)
    out = np.zeros((t, n_heads * head_dim))
    for h in range(n_heads):
        g = h // (n_heads // n_kv)
        qh = q[:, h * head_dim : (h + 1) * head_dim]
        kh = k[:, g * head_dim : (g + 1) * head_dim]
        vh = v[:, g * head_dim : (g + 1) * head_dim]
        if "q_norm" in p:
            qh = _rms(qh, p["q_norm"]["scale"], eps, gemma)
            kh = _rms(kh, p["k_norm"]["scale"], eps, gemma)
        qh, kh = _rotate(qh, positions, freqs), _rotate(kh, positions, freqs)
        scores = qh @ kh.T * scale
        if softcap is not None:
            scores = softcap * np.tanh(scores / softcap)
        for i in range(t):
            for j in range(t):
                seen = j <= i and (window is None or i - j < window) and segments[i] == segments[j]
                if not seen:
                    scores[i, j] = -np.inf
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[:, h * head_dim : (h + 1) * head_dim] = (scores / scores.sum(axis=-1, keepdims=True)) @ vh
    return out @ p["o"]["kernel"]


def _silu(x):
    return x / (1 + np.exp(-x))


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _mlp(x, p, act):
    return (act(x @ p["gate"]["kernel"]) * (x @ p["up"]["kernel"])) @ p["down"]["kernel"]


def llama_logits(params, cfg, tokens, positions=None, segments=None) -> np.ndarray:
    """Logits [B, T, vocab] of a Llama-style decoder (`cfg`: a LlamaConfig's fields) in float64."""
    out = []
    freqs = frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    for b in range(tokens.shape[0]):
        t = tokens.shape[1]
        pos = np.arange(t) if positions is None else positions[b]
        seg = np.zeros(t) if segments is None else segments[b]
        x = params["embed"]["embedding"][tokens[b]]
        for i in range(cfg.n_layers):
            p = params["blocks"][i]
            h = _rms(x, p["attn_norm"]["scale"], cfg.norm_eps)
            x = x + _attention(
                h,
                p["attn"],
                n_heads=cfg.n_heads,
                n_kv=cfg.n_kv_heads,
                head_dim=cfg.head_dim,
                scale=cfg.head_dim**-0.5,
                freqs=freqs,
                window=cfg.sliding_window,
                softcap=None,
                positions=pos,
                segments=seg,
                eps=cfg.norm_eps,
                gemma=False,
            )
            x = x + _mlp(_rms(x, p["mlp_norm"]["scale"], cfg.norm_eps), p["mlp"], _silu)
        x = _rms(x, params["final_norm"]["scale"], cfg.norm_eps)
        head = params["embed"]["embedding"].T if cfg.tie_embeddings else params["head"]["kernel"]
        out.append(x @ head)
    return np.stack(out)


def gemma_logits(params, cfg, tokens, positions=None, segments=None) -> np.ndarray:
    """Logits [B, T, vocab] of a Gemma-style decoder (`cfg`: a GemmaConfig's fields) in float64: layer i is
    global (whole context, rotary base rope_theta_global) when (i + 1) % global_every == 0 or there is no
    window, else local (the sliding window, rope_theta_local); norms gain 1 + scale, before and after
    attention and MLP; the embedding scaled by sqrt(d_model) and tied to the head."""
    out = []
    eps = cfg.norm_eps
    for b in range(tokens.shape[0]):
        t = tokens.shape[1]
        pos = np.arange(t) if positions is None else positions[b]
        seg = np.zeros(t) if segments is None else segments[b]
        x = params["embed"]["embedding"][tokens[b]] * math.sqrt(cfg.d_model)
        for i in range(cfg.n_layers):
            p = params["blocks"][i]
            is_global = cfg.sliding_window is None or (i + 1) % cfg.global_every == 0
            theta = cfg.rope_theta_global if is_global else cfg.rope_theta_local
            h = _rms(x, p["attn_norm"]["scale"], eps, True)
            a = _attention(
                h,
                p["attn"],
                n_heads=cfg.n_heads,
                n_kv=cfg.n_kv_heads,
                head_dim=cfg.head_dim,
                scale=cfg.query_pre_attn_scalar**-0.5,
                freqs=frequencies(cfg.head_dim, theta),
                window=None if is_global else cfg.sliding_window,
                softcap=cfg.attn_softcap,
                positions=pos,
                segments=seg,
                eps=eps,
                gemma=True,
            )
            x = x + _rms(a, p["post_attn_norm"]["scale"], eps, True)
            m = _mlp(_rms(x, p["mlp_norm"]["scale"], eps, True), p["mlp"], _gelu_tanh)
            x = x + _rms(m, p["post_mlp_norm"]["scale"], eps, True)
        logits = _rms(x, params["final_norm"]["scale"], eps, True) @ params["embed"]["embedding"].T
        if cfg.final_softcap is not None:
            logits = cfg.final_softcap * np.tanh(logits / cfg.final_softcap)
        out.append(logits)
    return np.stack(out)
