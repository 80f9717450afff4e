"""A float64 NumPy forward of the Llama-style (Llama 3, Mistral, Qwen 2/3) and Gemma-style (Gemma 2/3)
decoders, written from the published architectures, reading Hugging Face-named weights and a
config.json dict: the reference the checkpoint loader is checked against.

Llama: x = embed[tokens]; per layer h = x + o(attn(rms(x) * w_in)); x = h + down(silu(gate(n)) * up(n))
with n = rms(h) * w_post; logits = rms(x) * w_norm @ lm_head.T (or embed.T when tied). Attention uses
RoPE in rotate_half form (frequencies theta^(-2i/d), llama3's wavelength-banded scaling where asked),
grouped kv heads, 1/sqrt(head_dim) scaling, causal and optionally a sliding window (key j visible to
query i when i - j < window). Qwen 2 adds q/k/v biases, Qwen 3 an RMSNorm of each q and k head before
RoPE. Gemma: the embedding times sqrt(hidden_size), RMSNorms multiplying by (1 + weight), a norm
after attention and after the MLP as well as before each, GeGLU (tanh gelu), scaling
query_pre_attn_scalar^-0.5, an optional tanh soft-cap of the logits (and of the scores in Gemma 2
only: Gemma 3's attention ignores attn_logit_softcapping, as transformers' does), sliding-window layers
with their own RoPE base (Gemma 3 4B and up: the global layers' frequencies divided by a linear
scaling factor; Gemma 3: every `sliding_window_pattern`-th layer global; Gemma 2: odd
layers global), q/k norms in Gemma 3, a tied head.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def read_weights(directory: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a Hugging Face directory's safetensors files, as float64."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)
    from safetensors.numpy import load_file

    out = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        out.update({k: np.asarray(v, np.float64) for k, v in load_file(path).items()})
    return out


def rms_norm(x, weight, eps, plus_one=False):
    scale = (1.0 + weight) if plus_one else weight
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> np.ndarray:
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    assert kind == "llama3", scaling
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv
    smooth = (old / wavelength - low) / (high - low)
    banded = np.where(wavelength > old / low, inv / factor, inv)  # long wavelengths: divided
    middle = (wavelength <= old / low) & (wavelength >= old / high)
    return np.where(middle, (1 - smooth) * inv / factor + smooth * inv, banded)


def rope(x, positions, inv):
    """x: [T, heads, head_dim]; rotate_half form: pairs (i, i + head_dim / 2)."""
    angles = positions[:, None] * inv[None, :]
    cos = np.cos(np.concatenate([angles, angles], -1))[:, None, :]
    sin = np.sin(np.concatenate([angles, angles], -1))[:, None, :]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def attention(q, k, v, scale, window=None, softcap=None):
    """q: [T, H, d], k/v: [T, KV, d] (head h reads kv head h // (H / KV)); causal, optional window."""
    t, heads = q.shape[:2]
    group = heads // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = np.tanh(scores / softcap) * softcap
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    visible = j <= i
    if window:
        visible &= i - j < window
    scores = np.where(visible[None], scores, -np.inf)
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    probs = scores / scores.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, v)


def _rope_settings(cfg: dict) -> tuple[float, dict | None]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return params["rope_theta"], params
    return cfg.get("rope_theta", 10000.0), cfg.get("rope_scaling")


def _linear(w, name, x):
    y = x @ w[f"{name}.weight"].T
    return y + w[f"{name}.bias"] if f"{name}.bias" in w else y


def _heads(cfg: dict) -> tuple[int, int, int]:
    heads = cfg["num_attention_heads"]
    return heads, cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or cfg["hidden_size"] // heads


def llama_logits(cfg: dict, w: dict, tokens: np.ndarray) -> np.ndarray:
    """[batch, T, vocab] logits of a LlamaForCausalLM / Mistral / Qwen2 / Qwen3 checkpoint."""
    heads, kv, hd = _heads(cfg)
    eps = cfg.get("rms_norm_eps", 1e-6)
    theta, scaling = _rope_settings(cfg)
    inv = inverse_frequencies(hd, theta, scaling)
    qk_norm = cfg["architectures"][0] == "Qwen3ForCausalLM"
    window = cfg.get("sliding_window") if cfg["architectures"][0] == "MistralForCausalLM" else None
    head = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else w["lm_head.weight"]
    out = []
    for row in np.asarray(tokens):
        t = len(row)
        pos = np.arange(t, dtype=np.float64)
        x = w["model.embed_tokens.weight"][row]
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}"
            n = rms_norm(x, w[f"{p}.input_layernorm.weight"], eps)
            q = _linear(w, f"{p}.self_attn.q_proj", n).reshape(t, heads, hd)
            k = _linear(w, f"{p}.self_attn.k_proj", n).reshape(t, kv, hd)
            v = _linear(w, f"{p}.self_attn.v_proj", n).reshape(t, kv, hd)
            if qk_norm:
                q = rms_norm(q, w[f"{p}.self_attn.q_norm.weight"], eps)
                k = rms_norm(k, w[f"{p}.self_attn.k_norm.weight"], eps)
            att = attention(rope(q, pos, inv), rope(k, pos, inv), v, hd**-0.5, window)
            x = x + _linear(w, f"{p}.self_attn.o_proj", att.reshape(t, heads * hd))
            n = rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], eps)
            gate = _linear(w, f"{p}.mlp.gate_proj", n)
            x = x + _linear(w, f"{p}.mlp.down_proj", gate / (1 + np.exp(-gate)) * _linear(w, f"{p}.mlp.up_proj", n))
        out.append(rms_norm(x, w["model.norm.weight"], eps) @ head.T)
    return np.stack(out)


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def gemma_layer_types(cfg: dict) -> list[str]:
    n = cfg["num_hidden_layers"]
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    if cfg["architectures"][0] == "Gemma2ForCausalLM":
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    pattern = cfg.get("sliding_window_pattern", 6)
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]


def _gemma_thetas(cfg: dict) -> dict[str, float]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        return {kind: params[kind]["rope_theta"] for kind in ("full_attention", "sliding_attention")}
    theta = cfg.get("rope_theta", 10000.0)
    if cfg["architectures"][0] == "Gemma2ForCausalLM":
        return {"full_attention": theta, "sliding_attention": theta}
    return {"full_attention": theta, "sliding_attention": cfg.get("rope_local_base_freq", 10000.0)}


def _gemma_global_linear_factor(cfg: dict) -> float:
    """Gemma 3 4B and up divide the global layers' rotary frequencies by a linear scaling factor."""
    params = cfg.get("rope_parameters")
    scaling = params.get("full_attention") if isinstance(params, dict) and "full_attention" in params else None
    scaling = scaling or cfg.get("rope_scaling") or {}
    return float(scaling["factor"]) if scaling.get("rope_type") == "linear" else 1.0


def gemma_logits(cfg: dict, w: dict, tokens: np.ndarray) -> np.ndarray:
    """[batch, T, vocab] logits of a Gemma3ForCausalLM / Gemma2ForCausalLM checkpoint."""
    heads, kv, hd = _heads(cfg)
    eps = cfg.get("rms_norm_eps", 1e-6)
    qk_norm = cfg["architectures"][0] == "Gemma3ForCausalLM"
    score_cap = None if qk_norm else cfg.get("attn_logit_softcapping")  # Gemma 2 only
    thetas = _gemma_thetas(cfg)
    inv = {kind: inverse_frequencies(hd, theta) for kind, theta in thetas.items()}
    inv["full_attention"] = inv["full_attention"] / _gemma_global_linear_factor(cfg)
    types = gemma_layer_types(cfg)
    scale = cfg.get("query_pre_attn_scalar", hd) ** -0.5
    embed = w["model.embed_tokens.weight"]
    out = []
    for row in np.asarray(tokens):
        t = len(row)
        pos = np.arange(t, dtype=np.float64)
        x = embed[row] * math.sqrt(cfg["hidden_size"])
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}"

            def norm(y, name, p=p):
                return rms_norm(y, w[f"{p}.{name}.weight"], eps, plus_one=True)

            n = norm(x, "input_layernorm")
            q = _linear(w, f"{p}.self_attn.q_proj", n).reshape(t, heads, hd)
            k = _linear(w, f"{p}.self_attn.k_proj", n).reshape(t, kv, hd)
            v = _linear(w, f"{p}.self_attn.v_proj", n).reshape(t, kv, hd)
            if qk_norm:
                q, k = norm(q, "self_attn.q_norm"), norm(k, "self_attn.k_norm")
            kind = types[i]
            window = cfg.get("sliding_window") if kind == "sliding_attention" else None
            q, k = rope(q, pos, inv[kind]), rope(k, pos, inv[kind])
            att = attention(q, k, v, scale, window, score_cap)
            x = x + norm(_linear(w, f"{p}.self_attn.o_proj", att.reshape(t, heads * hd)), "post_attention_layernorm")
            n = norm(x, "pre_feedforward_layernorm")
            mlp = gelu_tanh(_linear(w, f"{p}.mlp.gate_proj", n)) * _linear(w, f"{p}.mlp.up_proj", n)
            x = x + norm(_linear(w, f"{p}.mlp.down_proj", mlp), "post_feedforward_layernorm")
        logits = rms_norm(x, w["model.norm.weight"], eps, plus_one=True) @ embed.T
        if cfg.get("final_logit_softcapping"):
            cap = cfg["final_logit_softcapping"]
            logits = np.tanh(logits / cap) * cap
        out.append(logits)
    return np.stack(out)


def logits(cfg: dict, weights: dict, tokens: np.ndarray) -> np.ndarray:
    """The reference logits of a checkpoint (config.json dict, weights by Hugging Face name)."""
    if cfg["architectures"][0].startswith("Gemma"):
        return gemma_logits(cfg, weights, tokens)
    return llama_logits(cfg, weights, tokens)


def weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config.json holds, by Hugging Face name, in torch's layout."""
    heads, kv, hd = _heads(cfg)
    d, f, arch = cfg["hidden_size"], cfg["intermediate_size"], cfg["architectures"][0]
    gemma = arch.startswith("Gemma")
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], d), "model.norm.weight": (d,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        norms = ["input_layernorm", "post_attention_layernorm"]
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if gemma else []
        shapes.update({f"{p}.{n}.weight": (d,) for n in norms})
        for part, width in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd)):
            shapes[f"{p}.self_attn.{part}_proj.weight"] = (width, d)
            if arch == "Qwen2ForCausalLM":
                shapes[f"{p}.self_attn.{part}_proj.bias"] = (width,)
        shapes[f"{p}.self_attn.o_proj.weight"] = (d, heads * hd)
        if arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"):
            shapes[f"{p}.self_attn.q_norm.weight"] = (hd,)
            shapes[f"{p}.self_attn.k_norm.weight"] = (hd,)
        shapes[f"{p}.mlp.gate_proj.weight"] = (f, d)
        shapes[f"{p}.mlp.up_proj.weight"] = (f, d)
        shapes[f"{p}.mlp.down_proj.weight"] = (d, f)
    if not gemma and not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (cfg["vocab_size"], d)
    return shapes


def random_weights(cfg: dict, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """Random weights of every tensor of `cfg` (norm weights around 1, or around 0 for Gemma's 1 + w)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith("norm.weight") or "layernorm" in name:
            base = 0.0 if cfg["architectures"][0].startswith("Gemma") else 1.0
            value = base + 0.1 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / math.sqrt(shape[-1])
        out[name] = value.astype(dtype)
    return out


def write_checkpoint(directory: str | Path, cfg: dict, weights: dict[str, np.ndarray], files: int = 1) -> Path:
    """A Hugging Face directory: config.json and the weights in `files` safetensors files (with an index)."""
    import json

    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    names = sorted(weights)
    if files == 1:
        save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
        return directory
    groups = [names[k::files] for k in range(files)]
    weight_map = {}
    for k, group in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        save_file({n: weights[n] for n in group}, directory / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory
