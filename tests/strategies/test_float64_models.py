"""A float64 model trains exactly (to float64 rounding) under the strategies whose loss sums used to be
float32: DDP with gradient accumulation and the pipeline failed to trace ("carry input and carry
output must have equal types" / "switch branches must have equal output types"). The loss is
reported in float32 whatever the model computes in; gradients and parameters stay float64."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.reference import train_single_device
from support.runs import train

from jaxdist.ddp.run import DDP
from jaxdist.engine.run import Units
from jaxdist.pipeline.run import Pipelined


class Block64(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(6, 6, param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.lin(x))


class MLP64(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.inp = nnx.Linear(4, 6, param_dtype=jnp.float64, rngs=rngs)
        self.blocks = nnx.List([Block64(rngs) for _ in range(2)])
        self.out = nnx.Linear(6, 3, param_dtype=jnp.float64, rngs=rngs)


UNITS = Units(embed=lambda m, b: m.inp(b["x"]), head_loss=lambda m, x, b: jnp.mean((m.out(x) - b["y"]) ** 2))


def loss(model, batch):
    x = UNITS.embed(model, batch)
    for block in model.blocks:
        x = block(x)
    return UNITS.head_loss(model, x, batch)


def prepare(name, batch):
    model, sgd = MLP64(nnx.Rngs(0)), optax.sgd(0.3)
    if name == "ddp-accumulation":
        return DDP(cpu_mesh((8,), ("dp",)), zero1=True, accumulation_steps=2).prepare(model, sgd, loss, batch)
    mesh = cpu_mesh((2, 4), ("pp", "dp"))
    return Pipelined(mesh, microbatches=2).prepare(model, sgd, UNITS, batch)


@pytest.mark.parametrize("name", ["ddp-accumulation", "pipeline"])
def test_a_float64_model_trains_as_on_one_device_in_float64(name):
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        batches = [{"x": rng.normal(size=(16, 4)), "y": rng.normal(size=(16, 3))} for _ in range(2)]
        ref_losses, ref_params, ref_norms, _ = train_single_device(
            lambda: MLP64(nnx.Rngs(0)), loss, batches, optax.sgd(0.3)
        )
        losses, params, norms, _ = train(prepare(name, batches[0]), batches)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-12)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)  # reported in float32
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        assert got.dtype == np.float64
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-14)
