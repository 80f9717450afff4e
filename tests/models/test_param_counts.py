"""Each released flavor has its published parameter count, both by `num_params()` and by the parameters
the module builds (counted on abstract shapes: nothing is allocated).

Counts: Llama 3.2 1B, Llama 3.1 8B and Qwen3-0.6B (tied) as published; the others computed from the
models' Hugging Face config.json values (vocab_size, hidden_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, head_dim, intermediate_size, tie_word_embeddings,
attention_bias / q-k norms), matching their published totals (Mistral 7B v0.1: 7,241,732,096;
Qwen2.5-0.5B: 494,032,768; Gemma 3 1B: 999,885,952; Qwen3-8B: 8,190,735,360). Gemma 3 4B's language
model (3,880,263,168; the published 4.3B counts its vision tower too) is also the count transformers builds
for that config (tests/models/test_hf_transformers.py).
"""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxdist.models import families

PUBLISHED = {
    ("llama", "llama3-1b"): 1_235_814_400,
    ("llama", "llama3-8b"): 8_030_261_248,
    ("llama", "qwen3-0.6b"): 596_049_920,
    ("llama", "qwen3-8b"): 8_190_735_360,
    ("llama", "qwen2.5-0.5b"): 494_032_768,
    ("llama", "mistral-7b"): 7_241_732_096,
    ("gemma", "gemma3-1b"): 999_885_952,
    ("gemma", "gemma3-4b"): 3_880_263_168,
}


def built_params(family: families.Family, cfg) -> int:
    abstract = nnx.eval_shape(lambda: family.model(cfg, nnx.Rngs(0)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.parametrize(("family", "flavor"), list(PUBLISHED), ids=[f for _, f in PUBLISHED])
def test_released_flavors_have_their_published_parameter_counts(family, flavor):
    fam = families.get(family)
    cfg = fam.flavors[flavor]
    assert cfg.num_params() == PUBLISHED[family, flavor]
    assert built_params(fam, cfg) == PUBLISHED[family, flavor]


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_every_flavor_builds_the_parameters_num_params_counts(family):
    """The small flavors too, each count being what the module holds."""
    fam = families.get(family)
    for name, cfg in fam.flavors.items():
        if cfg.num_params() < 2e8:
            assert built_params(fam, cfg) == cfg.num_params(), name


def test_the_cpu_flavors_and_the_released_ones_are_named_in_each_family():
    assert {"tiny", "small-cpu", "llama3-1b", "llama3-8b", "qwen3-0.6b", "qwen3-8b", "mistral-7b"} <= set(
        families.get("llama").flavors
    )
    assert {"tiny", "small-cpu", "gemma3-1b"} <= set(families.get("gemma").flavors)
