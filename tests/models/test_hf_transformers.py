"""jaxdist and the `transformers` library read each other's checkpoints and compute the same logits.

Both directions, for tiny Llama 3 (GQA, llama3 RoPE scaling, untied head), Qwen 3 (q/k norms, GQA,
head_dim != hidden / heads, tied) and Gemma 3 (sliding and global layers with their own RoPE bases,
soft-caps, query_pre_attn_scalar, tied) configs: weights made by transformers (norm weights
perturbed) and saved with `save_pretrained` load into jaxdist; weights made by jaxdist and written
by `jaxdist.models.hf.save` load into transformers with no missing, unexpected or mismatched
tensor. transformers runs eager attention in float32 on the CPU, jaxdist float32 at the highest
matmul precision on the CPU; the logits agree to 1e-4 of their scale. Skipped where transformers
and torch are not installed.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxdist.models import hf

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

TOLERANCE = 1e-4
LENGTH = 11  # longer than the sliding windows below


# transformers 5 spells RoPE settings as `rope_parameters` (per layer kind for Gemma 3); earlier versions
# as rope_theta / rope_scaling / rope_local_base_freq
NEW_ROPE = hasattr(transformers.LlamaConfig(), "rope_parameters")
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def rope(theta: float, scaling: dict | None = None) -> dict:
    if NEW_ROPE:
        return {"rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": theta}}
    return {"rope_theta": theta, "rope_scaling": scaling}


def gemma_rope(full: float, local: float, linear: float | None = None) -> dict:
    """Gemma 3's per-kind RoPE; `linear`: the global layers' linear scaling factor (Gemma 3 4B and up)."""
    scaling = {"rope_type": "linear", "factor": linear} if linear else None
    if NEW_ROPE:
        kinds = {"full_attention": (full, scaling), "sliding_attention": (local, None)}
        return {
            "rope_parameters": {
                k: {"rope_type": "default", **(sc or {}), "rope_theta": t} for k, (t, sc) in kinds.items()
            }
        }
    return {"rope_theta": full, "rope_local_base_freq": local, "rope_scaling": scaling}


def llama_config():
    return transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        **rope(500000.0, LLAMA3_SCALING),
        initializer_range=0.1,  # weights large enough that every part moves the logits
        tie_word_embeddings=False,
    )


def qwen3_config():
    return transformers.Qwen3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        **rope(1000000.0),
        initializer_range=0.1,  # weights large enough that every part moves the logits
        tie_word_embeddings=True,
    )


def gemma3_config(linear: float | None = None):
    return transformers.Gemma3TextConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        **gemma_rope(1000000.0, 10000.0, linear),
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=12,
        attn_logit_softcapping=None,  # as released: transformers' Gemma 3 ignores the key
        final_logit_softcapping=15.0,
        initializer_range=0.1,  # weights large enough that every part moves the logits
        tie_word_embeddings=True,
    )


def gemma3_4b_style_config():
    """Gemma 3 4B's RoPE: the global layers' positions scaled linearly by 8 (a small base, so it shows)."""
    config = gemma3_config(linear=8.0)
    return config


CONFIGS = {
    "llama": llama_config,
    "qwen3": qwen3_config,
    "gemma3": gemma3_config,
    "gemma3-linear-rope": gemma3_4b_style_config,
}


def hf_model(config):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # transformers initialises them to the identity: make a misread one show
                p.add_(0.1 * torch.randn_like(p))
    return model


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.double().numpy()


def jaxdist_logits(model, ids: np.ndarray) -> np.ndarray:
    with jax.default_matmul_precision("highest"), jax.default_device(jax.devices("cpu")[0]):
        return np.asarray(nnx.jit(lambda m, t: m(t))(model, ids), np.float64)


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    scale = np.abs(want).max()
    assert scale > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE * scale)


def tokens(vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (2, LENGTH)).astype(np.int64)


def cpu():
    return jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_weights_saved_by_transformers_give_its_logits_in_jaxdist(tmp_path, name):
    model = hf_model(CONFIGS[name]())
    model.save_pretrained(tmp_path)
    ids = tokens(model.config.vocab_size)
    ours = hf.load_model(tmp_path, sharding=cpu())
    assert_close(jaxdist_logits(ours, ids.astype(np.int32)), hf_logits(model, ids))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_weights_exported_by_jaxdist_give_its_logits_in_transformers(tmp_path, name):
    hf_model(CONFIGS[name]()).save_pretrained(tmp_path / "config")  # only its config.json is used
    loaded = hf.read_config(tmp_path / "config")
    model_cls, _ = hf.family_classes(loaded.family)
    with jax.default_device(jax.devices("cpu")[0]):
        ours = model_cls(loaded.config, nnx.Rngs(7))
    params = nnx.to_pure_dict(nnx.state(ours, nnx.Param))
    rng = np.random.default_rng(1)

    def perturbed(x):  # norm scales away from their initial value, so a misplaced one shows
        return x + 0.1 * rng.standard_normal(x.shape).astype(np.float32) if x.ndim == 1 else x

    params = jax.tree.map(perturbed, params)
    state = nnx.state(ours, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(ours, state)
    out = hf.save(tmp_path / "export", params, loaded.family, loaded.config)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", output_loading_info=True
    )
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids = tokens(loaded.config.vocab_size, seed=2)
    assert_close(jaxdist_logits(ours, ids.astype(np.int32)), hf_logits(theirs.float().eval(), ids))


def test_gemma3_4b_flavor_has_the_parameters_transformers_builds_for_its_config():
    from jaxdist.models import gemma

    cfg = gemma.FLAVORS["gemma3-4b"]
    config = transformers.Gemma3TextConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        sliding_window=cfg.sliding_window,
        query_pre_attn_scalar=int(cfg.query_pre_attn_scalar),
        **gemma_rope(cfg.rope_theta_global, cfg.rope_theta_local, cfg.rope_scale_global),
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    # the tied head is one tensor
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
