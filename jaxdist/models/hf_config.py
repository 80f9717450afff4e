"""Hugging Face `config.json` <-> jaxdist model configs, for the Llama-style and Gemma-style families.

`read` turns a checkpoint directory's config.json into a family name ("llama" or "gemma") and the
keyword arguments of `LlamaConfig` / `GemmaConfig`; `write` is the inverse for `config_json`. What a
family cannot represent (a bias on the output projection, an activation other than the family's,
a RoPE scaling other than llama3's, ...) is refused on one line naming the key and its value.
Both the legacy keys (rope_theta, rope_scaling, rope_local_base_freq) and the newer rope_parameters
are read; the legacy keys are written (every transformers version reads them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

CONFIG_FILE = "config.json"

LLAMA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
GEMMA_ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma2ForCausalLM")
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma2ForCausalLM": "gemma2",
}
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# transformers' defaults for the keys that change the math without changing any tensor's shape, where a
# config.json leaves one out (a missing key that changes a shape is refused by the weights' shapes instead)
TRANSFORMERS_DEFAULTS = {
    "MistralForCausalLM": {"sliding_window": 4096},
    "Gemma2ForCausalLM": {
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "Gemma3ForCausalLM": {"query_pre_attn_scalar": 256, "sliding_window": 4096},
}
DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "float64": "float64"}


class HFConfigError(ValueError):
    """A config.json jaxdist cannot represent, or a jaxdist config Hugging Face cannot; one line."""


def load_json(directory: str | Path) -> dict:
    """The config.json of a checkpoint directory (one-line errors for a missing or broken file)."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise HFConfigError(f"{Path(directory).absolute()} has no {CONFIG_FILE}; give a Hugging Face model directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HFConfigError(f"{path} is not valid JSON ({e})") from None


def architecture(hf: dict) -> str:
    """The checkpoint's one architecture (its `architectures` list), refused unless jaxdist reads it."""
    names = hf.get("architectures") or []
    if names == ["Gemma3ForConditionalGeneration"]:  # the released Gemma 3 4B, 12B, 27B: text and images
        raise HFConfigError(
            "Gemma3ForConditionalGeneration (Gemma 3 with its vision tower) is not read; save its language model "
            "alone as a Gemma3ForCausalLM directory (transformers: the model's language_model with its text_config) "
            "and point hf: at that"
        )
    if len(names) != 1 or names[0] not in LLAMA_ARCHITECTURES + GEMMA_ARCHITECTURES:
        supported = ", ".join(a for a in LLAMA_ARCHITECTURES + GEMMA_ARCHITECTURES if a != "Gemma2ForCausalLM")
        raise HFConfigError(f"unsupported architecture {names or hf.get('model_type')!r}; jaxdist reads {supported}")
    return names[0]


def read(hf: dict) -> tuple[str, dict[str, Any]]:
    """(family, config keyword arguments) of a parsed config.json; the dtypes are left to the caller."""
    arch = architecture(hf)
    hf = {**TRANSFORMERS_DEFAULTS.get(arch, {}), **hf}
    return ("llama", _llama(hf, arch)) if arch in LLAMA_ARCHITECTURES else ("gemma", _gemma(hf, arch))


def _get(hf: dict, key: str, default: Any = None) -> Any:
    value = hf.get(key, default)
    return default if value is None else value


def _require(hf: dict, arch: str, key: str, allowed, what: str) -> None:
    value = hf.get(key)
    if value not in allowed:
        raise HFConfigError(f"{arch} with {key}={value!r} is not supported ({what})")


def _common(hf: dict) -> dict[str, Any]:
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") if k not in hf]
    if missing:
        raise HFConfigError(f"config.json lacks {', '.join(missing)}; it is not a decoder model's config")
    heads = hf["num_attention_heads"]
    return {
        "vocab_size": hf["vocab_size"],
        "d_model": hf["hidden_size"],
        "n_layers": hf["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": _get(hf, "num_key_value_heads", heads),
        "head_dim": _get(hf, "head_dim", hf["hidden_size"] // heads),
        "d_ff": hf["intermediate_size"],
        "seq_len": _get(hf, "max_position_embeddings", 2048),
    }


def _rope(hf: dict) -> tuple[float, dict | None]:
    """(theta, scaling) of a single-RoPE model, as transformers 5 reads them: a legacy `rope_scaling` over
    `rope_parameters` when both are given, and `rope_theta` from the top level where the dict has none."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", _get(hf, "rope_theta", 10000.0))
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), scaling


def _llama(hf: dict, arch: str) -> dict[str, Any]:
    out = _common(hf)
    _require(hf, arch, "hidden_act", ("silu", None), "jaxdist's Llama MLP is SwiGLU: silu")
    _require(hf, arch, "mlp_bias", (False, None), "no MLP biases")
    theta, scaling = _rope(hf)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3" or any(k not in scaling for k in LLAMA3_ROPE_KEYS):
            raise HFConfigError(
                f"{arch} with rope_scaling={scaling!r} is not supported "
                f"(llama3 scaling with {', '.join(LLAMA3_ROPE_KEYS)})"
            )
        scaling = {"rope_type": "llama3", **{k: scaling[k] for k in LLAMA3_ROPE_KEYS}}
    qkv_bias = arch == "Qwen2ForCausalLM"
    if arch != "Qwen2ForCausalLM":  # Llama's and Qwen3's attention_bias also puts a bias on o_proj
        _require(hf, arch, "attention_bias", (False, None), "no bias on o_proj")
    window = None  # transformers' Llama has none whatever the config says; Qwen2/3's needs use_sliding_window
    if arch == "MistralForCausalLM":
        window = hf.get("sliding_window")
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        _require(hf, arch, "use_sliding_window", (False, None), "sliding windows on some layers only")
    types = set(hf.get("layer_types") or ())
    if types - {"full_attention", "sliding_attention"} or len(types) > 1:
        raise HFConfigError(f"{arch} with layer_types={sorted(types)} is not supported (one attention kind)")
    out.update(
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)),
        tie_embeddings=bool(_get(hf, "tie_word_embeddings", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        qkv_bias=qkv_bias,
        sliding_window=window,
    )
    return out


def _linear_factor(scaling: dict | None, arch: str, where: str) -> float:
    """The factor of a linear RoPE scaling (1.0 for none); any other kind is refused."""
    kind = None if not scaling else scaling.get("rope_type", "default")
    if kind in (None, "default"):
        return 1.0
    factor = scaling.get("factor")
    if kind != "linear" or not isinstance(factor, int | float) or isinstance(factor, bool) or not factor > 0:
        raise HFConfigError(f"{arch} with {where}={scaling!r} is not supported (default or linear RoPE, factor > 0)")
    return float(factor)


def _gemma_rope(hf: dict, arch: str) -> tuple[float, float, float]:
    """(local theta, global theta, global linear scale): Gemma 3 has a base per layer kind and scales the
    global layers' positions linearly from 4B up; Gemma 2 has one base for both. Read as transformers'
    Gemma 3 config reads them: a legacy `rope_scaling` is merged into the full-attention layers'
    parameters (over `rope_parameters` when both are present), its kind is its `rope_type` only."""
    legacy = hf.get("rope_scaling") or None
    if legacy is not None and "type" in legacy and "rope_type" not in legacy:
        # transformers 5 ignores "type" here (the scaling is dropped), earlier versions applied it
        raise HFConfigError(
            f"{arch} with rope_scaling={legacy!r} is read differently by transformers versions (the old 'type' key); "
            "write its kind as 'rope_type' in config.json"
        )
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full, local = dict(params["full_attention"] or {}), params.get("sliding_attention") or {}
        full.update(legacy or {})
        if _linear_factor(local, arch, "rope_parameters['sliding_attention']") != 1.0:
            raise HFConfigError(f"{arch} with rope_parameters['sliding_attention']={local!r} is not supported")
        scale = _linear_factor(full, arch, "rope_parameters['full_attention']")
        return float(local.get("rope_theta", 10000.0)), float(full.get("rope_theta", 1e6)), scale
    if isinstance(params, dict) and "rope_theta" in params:  # one set for both kinds (Gemma 2's spelling)
        theta, scaling = float(params["rope_theta"]), {k: v for k, v in params.items() if k != "rope_theta"}
        scaling.update(legacy or {})
    else:
        # transformers' Gemma 3 default base is 1e6 (Gemma 2's 1e4)
        theta = float(_get(hf, "rope_theta", 10000.0 if arch == "Gemma2ForCausalLM" else 1e6))
        scaling = legacy
    scale = _linear_factor(scaling, arch, "rope_scaling")
    if arch == "Gemma2ForCausalLM":
        if scale != 1.0:
            raise HFConfigError(f"{arch} with rope_scaling={scaling!r} is not supported (unscaled RoPE)")
        return theta, theta, 1.0
    return float(_get(hf, "rope_local_base_freq", 10000.0)), theta, scale


def _global_every(hf: dict, arch: str) -> int:
    """Every how many layers one attends globally (the others in a sliding window): layer i is global when
    (i + 1) % global_every == 0, as Gemma's sliding_window_pattern and layer_types say."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types:
        for every in range(1, n + 2):
            if types == [_layer_type(i, every) for i in range(n)]:
                return every
        raise HFConfigError(f"{arch} with layer_types={types!r} is not supported (a global layer every k layers)")
    if arch == "Gemma2ForCausalLM":
        return 2
    return int(_get(hf, "sliding_window_pattern", hf.get("_sliding_window_pattern", 6)))


def _layer_type(i: int, global_every: int) -> str:
    return "full_attention" if (i + 1) % global_every == 0 else "sliding_attention"


def _gemma(hf: dict, arch: str) -> dict[str, Any]:
    out = _common(hf)
    act = hf.get("hidden_activation", hf.get("hidden_act"))
    if act not in ("gelu_pytorch_tanh", None):
        raise HFConfigError(f"{arch} with hidden_activation={act!r} is not supported (gelu_pytorch_tanh)")
    _require(hf, arch, "attention_bias", (False, None), "no attention biases")
    _require(hf, arch, "use_bidirectional_attention", (False, None), "causal attention")
    if hf.get("tie_word_embeddings") is False:
        raise HFConfigError(f"{arch} with tie_word_embeddings=false is not supported (Gemma ties its head)")
    local, full, scale = _gemma_rope(hf, arch)
    out.update(
        rope_theta_local=local,
        rope_theta_global=full,
        rope_scale_global=scale,
        sliding_window=_get(hf, "sliding_window", 4096),
        global_every=_global_every(hf, arch),
        query_pre_attn_scalar=float(_get(hf, "query_pre_attn_scalar", out["head_dim"])),
        # transformers' Gemma 3 attention never soft-caps its logits (the key is read by Gemma 2 only; the
        # released Gemma 3 configs leave it null): a checkpoint means what that implementation computes
        attn_softcap=hf.get("attn_logit_softcapping") if arch == "Gemma2ForCausalLM" else None,
        final_softcap=hf.get("final_logit_softcapping"),
        norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)),
    )
    if arch == "Gemma2ForCausalLM":
        out["qk_norm"] = False  # the one structural difference to Gemma 3 (which has q/k norms)
    return out


def _llama_rope_scaling(scaling) -> dict | None:
    """A Llama config's rope_scaling as config.json spells it: with its kind (`rope_frequencies` reads a dict
    without one as llama3; transformers, as none)."""
    if not scaling:
        return None
    return {"rope_type": scaling.get("rope_type", scaling.get("type", "llama3")), **dict(scaling)}


def llama_architecture(cfg) -> str:
    """The transformers class a Llama-style config is: Qwen3 (q/k norms), Qwen2 (q/k/v biases), Mistral
    (a sliding window) or Llama."""
    flags = [name for name, on in (("qk_norm", cfg.qk_norm), ("qkv_bias", cfg.qkv_bias)) if on]
    if len(flags) > 1 or (flags and cfg.sliding_window):
        on = flags + (["sliding_window"] if cfg.sliding_window else [])
        raise HFConfigError(f"no transformers architecture has {' and '.join(on)} together; export a model with one")
    if cfg.qk_norm:
        return "Qwen3ForCausalLM"
    if cfg.qkv_bias:
        return "Qwen2ForCausalLM"
    return "MistralForCausalLM" if cfg.sliding_window else "LlamaForCausalLM"


def write(family: str, cfg, torch_dtype: str) -> dict[str, Any]:
    """The config.json of a jaxdist config (family "llama" or "gemma"); tensors stored in `torch_dtype`."""
    common = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": float(cfg.norm_eps),
        "torch_dtype": torch_dtype,
        "use_cache": True,
    }
    if family == "llama":
        arch = llama_architecture(cfg)
        out = {
            **common,
            "hidden_act": "silu",
            "rope_theta": float(cfg.rope_theta),
            "rope_scaling": _llama_rope_scaling(cfg.rope_scaling),
            "tie_word_embeddings": bool(cfg.tie_embeddings),
            "attention_bias": False,
            "mlp_bias": False,
        }
        if arch == "MistralForCausalLM":
            out["sliding_window"] = cfg.sliding_window
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            out.update(use_sliding_window=False, sliding_window=None)
        if arch == "Qwen2ForCausalLM":
            del out["attention_bias"]
    elif family == "gemma":
        gemma2 = not getattr(cfg, "qk_norm", True)
        arch = "Gemma2ForCausalLM" if gemma2 else "Gemma3ForCausalLM"
        if gemma2 and (cfg.rope_theta_local != cfg.rope_theta_global or cfg.global_every != 2):
            raise HFConfigError(
                "a Gemma model without q/k norms is Gemma 2, which has one rope_theta and global_every=2; "
                f"this one has rope_theta_local={cfg.rope_theta_local}, rope_theta_global={cfg.rope_theta_global}, "
                f"global_every={cfg.global_every}"
            )
        if not gemma2 and cfg.attn_softcap is not None:
            raise HFConfigError(
                f"a Gemma model with q/k norms is Gemma 3, whose attention has no soft-cap in transformers (it "
                f"ignores attn_logit_softcapping), and it would compute other logits than this model with "
                f"attn_softcap={cfg.attn_softcap}: export a model with attn_softcap=None"
            )
        out = {
            **common,
            "hidden_activation": "gelu_pytorch_tanh",
            "rope_theta": float(cfg.rope_theta_global),
            # the global layers' (transformers reads legacy rope_scaling as the full-attention layers')
            "rope_scaling": (
                {"rope_type": "linear", "factor": float(cfg.rope_scale_global)}
                if cfg.rope_scale_global != 1.0
                else None
            ),
            # no window: every layer global (a window the context's length, for transformers' int field)
            "sliding_window": cfg.sliding_window or cfg.seq_len,
            "query_pre_attn_scalar": _number(cfg.query_pre_attn_scalar),
            "attn_logit_softcapping": None if cfg.attn_softcap is None else float(cfg.attn_softcap),
            "final_logit_softcapping": None if cfg.final_softcap is None else float(cfg.final_softcap),
            "tie_word_embeddings": True,
            "attention_bias": False,
            "layer_types": [_layer_type(i, cfg.global_every if cfg.sliding_window else 1) for i in range(cfg.n_layers)],
        }
        if not gemma2:
            every = cfg.global_every if cfg.sliding_window else 1
            out.update(rope_local_base_freq=float(cfg.rope_theta_local), sliding_window_pattern=every)
    else:
        raise HFConfigError(f"unknown model family {family!r}; Hugging Face export knows llama and gemma")
    return {"architectures": [arch], "model_type": MODEL_TYPES[arch], **out}


def _number(x: float) -> int | float:
    """An integral float as an int (transformers declares query_pre_attn_scalar an int)."""
    return int(x) if float(x).is_integer() else float(x)


def torch_dtype_name(dtype) -> str:
    """A NumPy/JAX dtype as config.json's torch_dtype ("float32", "bfloat16", ...)."""
    name = np.dtype(dtype).name
    if name not in DTYPE_NAMES:
        raise HFConfigError(f"Hugging Face checkpoints hold floating-point tensors, not {name}")
    return DTYPE_NAMES[name]
