"""A float64 model trains exactly (to float64 rounding) under the strategies whose loss sums used to be
float32: DDP with gradient accumulation and the pipeline failed to trace ("carry input and carry
output must have equal types" / "switch branches must have equal output types"). The loss is
reported in float32 whatever the model computes in; gradients and parameters stay float64."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.models import MLP64, UNITS64, loss64
from support.reference import train_single_device
from support.runs import train

from jaxdist.ddp.run import DDP
from jaxdist.pipeline.run import Pipelined


def prepare(name, batch):
    model, sgd = MLP64(nnx.Rngs(0)), optax.sgd(0.3)
    if name == "ddp-accumulation":
        return DDP(cpu_mesh((8,), ("dp",)), zero1=True, accumulation_steps=2).prepare(model, sgd, loss64, batch)
    mesh = cpu_mesh((2, 4), ("pp", "dp"))
    return Pipelined(mesh, microbatches=2).prepare(model, sgd, UNITS64, batch)


@pytest.mark.parametrize("name", ["ddp-accumulation", "pipeline"])
def test_a_float64_model_trains_as_on_one_device_in_float64(name):
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        batches = [{"x": rng.normal(size=(16, 4)), "y": rng.normal(size=(16, 2))} for _ in range(2)]
        ref_losses, ref_params, ref_norms, _ = train_single_device(
            lambda: MLP64(nnx.Rngs(0)), loss64, batches, optax.sgd(0.3)
        )
        losses, params, norms, _ = train(prepare(name, batches[0]), batches)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-12)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)  # reported in float32
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        assert got.dtype == np.float64
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-14)
