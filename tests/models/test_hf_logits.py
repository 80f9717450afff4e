"""A Hugging Face directory loaded into jaxdist computes the logits of the published architecture.

The reference is tests/support/hf_reference.py: a float64 NumPy forward written from the published
Llama / Mistral / Qwen 2 / Qwen 3 / Gemma 3 architectures, reading the files' tensors by their
Hugging Face names and the config.json as transformers reads it. The checkpoints are random
weights written by the test (norm weights perturbed, so a norm read from the wrong tensor shows),
with sequences longer than the sliding windows. jaxdist runs in float32 at the highest matmul
precision on the CPU: its logits match to 2e-5 of the logits' scale (float32 rounding over a
2-3 layer model; a wrong transpose, norm or rotation is off by O(1)). The export -> reload round trip
is checked too, against the directory's own logits.
"""

import re

import jax
import numpy as np
import pytest
from flax import nnx
from support import hf_configs, hf_reference

from jaxdist.models import hf

TOLERANCE = 2e-5
GEMMA2_UNSUPPORTED = "Gemma2ForCausalLM (no q/k norms) is not supported"
READ = [name for name in hf_configs.ALL if name != "gemma2"]


def tokens(cfg: dict, batch: int = 2, length: int = 11, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, cfg["vocab_size"], (batch, length)).astype(np.int32)


def cpu_logits(model, ids: np.ndarray) -> np.ndarray:
    with jax.default_matmul_precision("highest"), jax.default_device(jax.devices("cpu")[0]):
        return np.asarray(nnx.jit(lambda m, t: m(t))(model, ids), np.float64)


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    scale = np.abs(want).max()
    assert scale > 0.5  # the logits are not vanishingly small: the comparison has something to see
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE * scale)


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    out = {}
    for name, cfg in hf_configs.ALL.items():
        weights = hf_reference.random_weights(cfg, seed=3)
        out[name] = (hf_reference.write_checkpoint(tmp_path_factory.mktemp(name), cfg, weights, files=2), cfg, weights)
    return out


@pytest.mark.parametrize("name", READ)
def test_loaded_model_logits_equal_the_float64_reference(directories, name):
    path, cfg, weights = directories[name]
    model = hf.load_model(path, sharding=jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0]))
    ids = tokens(cfg)
    assert_close(cpu_logits(model, ids), hf_reference.logits(cfg, weights, ids))


def test_the_reference_sees_a_misread_norm(directories):
    """The control: the comparison fails when one norm weight is read from the wrong tensor."""
    path, cfg, weights = directories["gemma3"]
    swapped = dict(weights)
    a, b = "model.layers.0.pre_feedforward_layernorm.weight", "model.layers.0.post_feedforward_layernorm.weight"
    swapped[a], swapped[b] = weights[b], weights[a]
    model = hf.load_model(path, sharding=jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0]))
    ids = tokens(cfg)
    with pytest.raises(AssertionError):
        assert_close(cpu_logits(model, ids), hf_reference.logits(cfg, swapped, ids))


def test_gemma2_is_refused_naming_what_jaxdist_lacks(directories):
    path, _, _ = directories["gemma2"]
    with pytest.raises(ValueError, match=re.escape(GEMMA2_UNSUPPORTED)):
        hf.load_model(path)


@pytest.mark.parametrize("name", READ)
def test_export_and_reload_keeps_the_logits(directories, tmp_path, name):
    path, cfg, weights = directories[name]
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    model = hf.load_model(path, sharding=cpu)
    loaded = hf.read_config(path)
    out = hf.save(tmp_path / "out", nnx.to_pure_dict(nnx.state(model, nnx.Param)), loaded.family, loaded.config)
    ids = tokens(cfg, seed=1)
    again = hf.load_model(out, sharding=cpu)
    np.testing.assert_array_equal(cpu_logits(again, ids), cpu_logits(model, ids))
    assert hf_reference.read_weights(out).keys() == weights.keys()
