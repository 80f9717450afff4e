"""config.json <-> jaxdist configs: both spellings transformers writes read the same, what jaxdist cannot
represent is refused naming the key, and written configs read back as the same model."""

import copy
import json

import pytest
from support import hf_configs

from jaxdist.models import GemmaConfig, LlamaConfig, hf, hf_config
from jaxdist.models.hf_config import HFConfigError


def changed(cfg: dict, **values) -> dict:
    out = copy.deepcopy(cfg)
    for k, v in values.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def test_llama_keys_map_onto_the_llama_config():
    family, kw = hf_config.read(hf_configs.LLAMA)
    assert family == "llama"
    assert (kw["d_model"], kw["n_layers"], kw["n_heads"], kw["n_kv_heads"], kw["head_dim"], kw["d_ff"]) == (
        32,
        2,
        4,
        2,
        8,
        64,
    )
    assert kw["rope_theta"] == 500000.0 and kw["rope_scaling"]["rope_type"] == "llama3"
    assert (kw["qk_norm"], kw["qkv_bias"], kw["tie_embeddings"], kw["sliding_window"]) == (False, False, False, None)
    assert hf_config.read(hf_configs.QWEN3)[1]["qk_norm"] and hf_config.read(hf_configs.QWEN2)[1]["qkv_bias"]
    assert hf_config.read(hf_configs.MISTRAL)[1]["sliding_window"] == 5
    assert hf_config.read(changed(hf_configs.QWEN2, num_key_value_heads=None))[1]["n_kv_heads"] == 4
    assert hf_config.read(changed(hf_configs.QWEN2, head_dim=None))[1]["head_dim"] == 8  # hidden / heads


def test_rope_parameters_read_as_the_legacy_keys():
    theta, scaling = hf_configs.LLAMA["rope_theta"], hf_configs.LLAMA["rope_scaling"]
    newer = changed(hf_configs.LLAMA, rope_theta=None, rope_scaling=None)
    newer["rope_parameters"] = {"rope_theta": theta, **scaling}
    assert hf_config.read(newer) == hf_config.read(hf_configs.LLAMA)
    plain = changed(hf_configs.QWEN3, rope_theta=None)
    plain["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    assert hf_config.read(plain) == hf_config.read(hf_configs.QWEN3)


def test_gemma3_layer_types_and_per_kind_rope_read_as_the_pattern_keys():
    family, kw = hf_config.read(hf_configs.GEMMA3)
    assert family == "gemma" and kw["global_every"] == 2 and kw["sliding_window"] == 4
    assert (kw["rope_theta_local"], kw["rope_theta_global"]) == (10000.0, 1000000.0)
    # Gemma 3's attention has no soft-cap: transformers ignores attn_logit_softcapping there
    assert (kw["query_pre_attn_scalar"], kw["attn_softcap"], kw["final_softcap"]) == (12, None, 15.0)
    newer = changed(hf_configs.GEMMA3, rope_theta=None, rope_local_base_freq=None, sliding_window_pattern=None)
    newer["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention"]
    newer["rope_parameters"] = {
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    assert hf_config.read(newer) == (family, kw)


@pytest.mark.parametrize(
    ("name", "key", "field", "default"),
    [
        ("gemma3", "query_pre_attn_scalar", "query_pre_attn_scalar", 256),
        ("gemma2", "query_pre_attn_scalar", "query_pre_attn_scalar", 256),
        ("gemma2", "attn_logit_softcapping", "attn_softcap", 50.0),
        ("gemma2", "final_logit_softcapping", "final_softcap", 30.0),
        ("gemma3", "sliding_window", "sliding_window", 4096),
        ("mistral", "sliding_window", "sliding_window", 4096),
    ],
)
def test_a_missing_key_that_changes_no_shape_reads_as_transformers_default(name, key, field, default):
    """A hand-written or trimmed config.json: what transformers computes with it (Gemma's query scale is
    not head_dim**-0.5, Gemma 2 soft-caps, Mistral has a window)."""
    assert hf_config.read(changed(hf_configs.ALL[name], **{key: None}))[1][field] == default


def test_a_key_set_to_null_keeps_its_meaning():
    assert hf_config.read({**hf_configs.MISTRAL, "sliding_window": None})[1]["sliding_window"] is None
    kw = hf_config.read({**hf_configs.GEMMA2, "attn_logit_softcapping": None, "final_logit_softcapping": None})[1]
    assert (kw["attn_softcap"], kw["final_softcap"]) == (None, None)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (changed(hf_configs.LLAMA, architectures=["GPT2LMHeadModel"]), "unsupported architecture ['GPT2LMHeadModel']"),
        (changed(hf_configs.LLAMA, attention_bias=True), "LlamaForCausalLM with attention_bias=True is not supported"),
        (changed(hf_configs.LLAMA, mlp_bias=True), "with mlp_bias=True is not supported"),
        (changed(hf_configs.LLAMA, hidden_act="gelu"), "with hidden_act='gelu' is not supported"),
        (
            changed(hf_configs.LLAMA, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
            "rope_scaling={'rope_type': 'yarn'",
        ),
        (changed(hf_configs.QWEN3, use_sliding_window=True), "with use_sliding_window=True is not supported"),
        (
            changed(hf_configs.GEMMA3, rope_scaling={"rope_type": "yarn", "factor": 8.0}),
            "Gemma3ForCausalLM with rope_",
        ),
        (changed(hf_configs.GEMMA3, use_bidirectional_attention=True), "use_bidirectional_attention=True"),
        (
            changed(hf_configs.GEMMA3, layer_types=["full_attention", "sliding_attention", "full_attention"]),
            "layer_typ",
        ),
        (changed(hf_configs.LLAMA, hidden_size=None), "config.json lacks hidden_size"),
    ],
)
def test_what_jaxdist_cannot_represent_is_refused_naming_the_key(cfg, message):
    with pytest.raises(HFConfigError) as e:
        hf_config.read(cfg)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", [n for n in hf_configs.ALL if n != "gemma2"])
def test_a_written_config_reads_back_as_the_same_model(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps(hf_configs.ALL[name]))
    model = hf.read_config(tmp_path)
    written = hf_config.write(model.family, model.config, "float32")
    assert written["architectures"] == hf_configs.ALL[name]["architectures"]
    assert hf_config.read(written) == hf_config.read(hf_configs.ALL[name])


def test_a_gemma_model_without_a_window_is_written_with_every_layer_global():
    cfg = GemmaConfig(
        vocab_size=64,
        d_model=32,
        n_layers=3,
        n_heads=2,
        n_kv_heads=1,
        head_dim=16,
        d_ff=64,
        sliding_window=None,
        seq_len=128,
    )
    written = hf_config.write("gemma", cfg, "float32")
    assert written["layer_types"] == ["full_attention"] * 3 and written["sliding_window"] == 128
    assert hf_config.read(written)[1]["global_every"] == 1


def test_a_llama_config_no_architecture_has_is_refused_on_export():
    cfg = LlamaConfig(qk_norm=True, qkv_bias=True)
    with pytest.raises(HFConfigError, match="no transformers architecture has qk_norm and qkv_bias together"):
        hf_config.write("llama", cfg, "float32")


def test_a_gemma3_with_an_attention_soft_cap_is_refused_on_export():
    # transformers' Gemma 3 would load it and silently compute uncapped scores: different logits
    cfg = GemmaConfig(attn_softcap=20.0)
    with pytest.raises(HFConfigError, match="Gemma 3, whose attention has no soft-cap in transformers"):
        hf_config.write("gemma", cfg, "float32")
    assert hf_config.write("gemma", GemmaConfig(), "float32")["attn_logit_softcapping"] is None


def test_read_config_overrides_fields_and_refuses_unknown_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_configs.QWEN3))
    assert hf.read_config(tmp_path, seq_len=32).config.seq_len == 32
    with pytest.raises(HFConfigError, match="LlamaConfig has no field d_modle"):
        hf.read_config(tmp_path, d_modle=3)


def test_gemma3_linear_rope_scaling_of_the_global_layers_reads_in_both_spellings_and_writes_back():
    legacy = changed(hf_configs.GEMMA3, rope_scaling={"rope_type": "linear", "factor": 8.0})
    family, kw = hf_config.read(legacy)
    assert kw["rope_scale_global"] == 8.0 and kw["rope_theta_local"] == 10000.0
    newer = changed(hf_configs.GEMMA3, rope_theta=None, rope_local_base_freq=None, sliding_window_pattern=None)
    newer["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention"]
    newer["rope_parameters"] = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    assert hf_config.read(newer) == (family, kw)
    written = hf_config.write("gemma", GemmaConfig(**kw), "float32")
    assert written["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert hf_config.read(written)[1]["rope_scale_global"] == 8.0
    assert hf_config.read(hf_configs.GEMMA3)[1]["rope_scale_global"] == 1.0


@pytest.mark.parametrize(
    "scaling",
    [{"rope_type": "yarn", "factor": 8.0}, {"rope_type": "linear"}],
    ids=["yarn", "linear-without-factor"],
)
def test_gemma3_rope_scaling_other_than_linear_is_refused_by_name(scaling):
    with pytest.raises(
        HFConfigError, match=r"Gemma3ForCausalLM with rope_scaling=.* is not supported \(default or linear"
    ):
        hf_config.read(changed(hf_configs.GEMMA3, rope_scaling=scaling))


def test_gemma3_rope_keys_read_as_transformers_merges_them():
    linear = {"rope_type": "linear", "factor": 8}
    both = changed(hf_configs.GEMMA3, rope_theta=None, rope_local_base_freq=None, rope_scaling=linear)
    both["rope_parameters"] = {
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    # the legacy key is merged into the full-attention layers' parameters
    assert hf_config.read(both)[1]["rope_scale_global"] == 8.0
    # transformers' Gemma 3 default base of the global layers is 1e6
    assert hf_config.read(changed(hf_configs.GEMMA3, rope_theta=None))[1]["rope_theta_global"] == 1e6
    assert hf_config.read(changed(hf_configs.GEMMA3, rope_scaling=None))[1]["rope_scale_global"] == 1.0
    with pytest.raises(HFConfigError, match=r"the old 'type' key\); write its kind as 'rope_type'"):
        hf_config.read(changed(hf_configs.GEMMA3, rope_scaling={"type": "linear", "factor": 8.0}))
    with pytest.raises(HFConfigError, match="default or linear RoPE, factor > 0"):
        hf_config.read(changed(hf_configs.GEMMA3, rope_scaling={"rope_type": "linear", "factor": 0}))


def test_the_multimodal_gemma3_is_refused_naming_its_language_model_as_the_way():
    with pytest.raises(HFConfigError, match="Gemma3ForConditionalGeneration .* save its language model alone"):
        hf_config.read(changed(hf_configs.GEMMA3, architectures=["Gemma3ForConditionalGeneration"]))


def test_rope_keys_read_as_transformers_5_merges_them():
    """transformers 5: `rope_scaling or rope_parameters` (the legacy key wins where both are given), and a
    rope_parameters without its own rope_theta takes the top-level one. jaxdist read rope_parameters first
    and dropped its scaling where it had no rope_theta: unscaled RoPE, silently."""
    llama3 = hf_configs.LLAMA["rope_scaling"]
    both = copy.deepcopy(hf_configs.LLAMA)
    both["rope_parameters"] = {"rope_type": "default", "rope_theta": 500.0}
    assert hf_config.read(both) == hf_config.read(hf_configs.LLAMA)
    no_theta = changed(hf_configs.LLAMA, rope_scaling=None)
    no_theta["rope_parameters"] = dict(llama3)
    assert hf_config.read(no_theta) == hf_config.read(hf_configs.LLAMA)


def test_a_llama3_rope_scaling_without_its_kind_is_written_with_it():
    """The model reads a rope_scaling without rope_type as llama3; config.json must say so, or every reader
    (transformers, jaxdist) takes it as unscaled."""
    scaling = {k: v for k, v in hf_configs.LLAMA["rope_scaling"].items() if k not in ("rope_type", "type")}
    written = hf_config.write("llama", LlamaConfig(rope_scaling=scaling), "float32")
    assert written["rope_scaling"] == {"rope_type": "llama3", **scaling}
    assert hf_config.read(written)[1]["rope_scaling"] == {"rope_type": "llama3", **scaling}


@pytest.mark.parametrize(
    "cfg",
    [
        changed(hf_configs.LLAMA, layer_types=["sliding_attention"] * 2, sliding_window=3),
        changed(hf_configs.QWEN3, layer_types=["sliding_attention"] * 2, sliding_window=3, use_sliding_window=False),
    ],
    ids=["llama", "qwen3"],
)
def test_a_window_transformers_does_not_apply_is_not_applied(cfg):
    # transformers' Llama has no sliding window; Qwen3's config drops it unless use_sliding_window
    assert hf_config.read(cfg)[1]["sliding_window"] is None


def test_the_unsupported_architecture_message_lists_only_what_is_read():
    with pytest.raises(HFConfigError) as e:
        hf_config.read(changed(hf_configs.LLAMA, architectures=["GemmaForCausalLM"]))
    assert "Gemma3ForCausalLM" in str(e.value) and "Gemma2ForCausalLM" not in str(e.value)
