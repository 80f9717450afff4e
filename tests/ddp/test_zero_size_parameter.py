"""A parameter with a size-0 dimension (a prefix of no tokens): ZeRO-1 without packing gathered a
zero-sized chunk, which XLA refuses to compile. Such a parameter is left whole, and the run trains as
one device does."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.reference import assert_same_training, train_single_device
from support.runs import train

from jaxdist.ddp.run import DDP


class WithEmptyPrefix(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(8, 8, rngs=rngs)
        self.prefix = nnx.Param(jnp.zeros((0, 8)))

    def __call__(self, x):
        return self.lin(x) + self.prefix[...].sum(0)


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


@pytest.mark.parametrize("pack_buckets", [True, False])
def test_a_size_0_parameter_trains_under_zero1_as_on_one_device(pack_buckets):
    rng = np.random.default_rng(0)
    batches = [{k: rng.normal(size=(8, 8)).astype(np.float32) for k in ("x", "y")} for _ in range(2)]
    run = DDP(cpu_mesh((4,), ("dp",)), zero1=True, pack_buckets=pack_buckets).prepare(
        WithEmptyPrefix(nnx.Rngs(0)), optax.sgd(0.1), loss_fn, batches[0]
    )
    want = train_single_device(lambda: WithEmptyPrefix(nnx.Rngs(0)), loss_fn, batches, optax.sgd(0.1))
    assert_same_training(train(run, batches), want)
