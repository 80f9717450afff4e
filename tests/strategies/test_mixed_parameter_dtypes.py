"""A model of mixed parameter dtypes (bfloat16 layers, a float32 gain: mixed precision kept by hand)
under the unit engine. A unit's pieces travel in communication buffers; one buffer concatenated
from pieces of two dtypes promotes them all, so a bfloat16 kernel arrived in its block as float32
and the block computed in float32 where one device computes in bfloat16 (and the collective moved
twice the bytes). Checked against a single-device run of the same model.
"""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.reference import train_single_device
from support.runs import train

from jaxdist.engine.run import Parallel, Units
from jaxdist.pipeline.run import Pipelined

SEEN = []  # (kernel dtype, activation dtype) each block saw when traced


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(16, 16, param_dtype=jnp.bfloat16, rngs=rngs)  # computes in its inputs' dtype
        self.gain = nnx.Param(jnp.linspace(0.5, 1.5, 16, dtype=jnp.float32))  # a float32 master value

    def __call__(self, x):
        SEEN.append((self.lin.kernel.dtype, x.dtype))
        return x + jnp.tanh(self.lin(x)) * self.gain[...].astype(x.dtype)


class Mixed(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.inp = nnx.Linear(8, 16, param_dtype=jnp.bfloat16, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])
        self.out = nnx.Linear(16, 4, param_dtype=jnp.bfloat16, rngs=rngs)


def embed(model, batch):
    return model.inp(batch["x"].astype(jnp.bfloat16))


def head_loss(model, x, batch):
    return jnp.mean((model.out(x).astype(jnp.float32) - batch["y"]) ** 2)


def loss(model, batch):
    x = embed(model, batch)
    for block in model.blocks:
        x = block(x)
    return head_loss(model, x, batch)


def batches(n=2, rows=16, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {"x": rng.normal(size=(rows, 8)).astype(np.float32), "y": rng.normal(size=(rows, 4)).astype(np.float32)}
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def one_device():
    return train_single_device(lambda: Mixed(nnx.Rngs(0)), loss, batches(), optax.sgd(0.1))


STRATEGIES = {
    "fsdp8": lambda: Parallel(cpu_mesh((8,), ("fsdp",))),
    "fsdp8-grouped": lambda: Parallel(cpu_mesh((8,), ("fsdp",)), pack_units=False),  # a group of both dtypes
    "hsdp2x4": lambda: Parallel(cpu_mesh((2, 4), ("dp", "fsdp"))),
    "zero1-8": lambda: Parallel(cpu_mesh((8,), ("dp",))),
    "pp2xfsdp4": lambda: Pipelined(cpu_mesh((2, 4), ("pp", "fsdp")), microbatches=2),
}


# HSDP is slow: its fsdp axis is fsdp8's and its dp axis zero1-8's
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow if n == "hsdp2x4" else ()) for n in STRATEGIES]
)
def test_bfloat16_parameters_beside_float32_ones_compute_in_bfloat16(one_device, name):
    SEEN.clear()
    run = STRATEGIES[name]().prepare(Mixed(nnx.Rngs(0)), optax.sgd(0.1), Units(embed, head_loss), batches()[0])
    losses, params, _, state = train(run, batches())
    bf16 = jnp.dtype(jnp.bfloat16)
    assert SEEN and set(SEEN) == {(bf16, bf16)}, set(SEEN)  # as on one device
    ref_losses, ref_params, _, _ = one_device
    # the first step's loss is the same forward (float32 activations from a float32 kernel: 2e-3 off)
    np.testing.assert_allclose(losses[0], ref_losses[0], rtol=1e-6)
    np.testing.assert_allclose(losses[1], ref_losses[1], rtol=2e-3)  # bfloat16 gradients averaged over ranks
    for got, want in zip(
        (params["blocks"][0]["lin"]["kernel"], params["blocks"][1]["gain"]),
        (ref_params["blocks"][0]["lin"]["kernel"], ref_params["blocks"][1]["gain"]),
        strict=True,
    ):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-2)
    assert state.params["blocks"][0]["lin"]["kernel"].dtype == jnp.bfloat16
