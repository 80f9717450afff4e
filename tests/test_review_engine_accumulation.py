"""DDP gradient accumulation of bfloat16 parameters with `reduce_dtype=float32` (reduce in float32 to
keep the gradient's precision): the micro-batches' gradients were summed in bfloat16 before the
float32 reduction, so the step's gradient lost what the float32 reduction keeps (its norm 2.4e-4
off, where float32 is exact to 1e-8). Compared with float64 numpy: each rank's micro-batch gradient
as one device computes it in bfloat16, widened and averaged."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from meshes import cpu_mesh

from jaxdist.ddp import DDP

DP, MICRO = 2, 8


class Bf16MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.a = nnx.Linear(8, 32, param_dtype=jnp.bfloat16, rngs=rngs)
        self.b = nnx.Linear(32, 4, param_dtype=jnp.bfloat16, rngs=rngs)


def loss(model, batch):
    h = jnp.tanh(model.a(batch["x"].astype(jnp.bfloat16)))
    return jnp.mean((model.b(h).astype(jnp.float32) - batch["y"]) ** 2)


def batch(seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(64, 8)).astype(np.float32), "y": rng.normal(size=(64, 4)).astype(np.float32)}


def reference_norm(global_batch) -> float:
    """The norm of the mean, in float64, of every (rank, micro-batch)'s bfloat16 gradient."""
    graphdef, params, rest = nnx.split(Bf16MLP(nnx.Rngs(0)), nnx.Param, ...)
    grad = jax.jit(jax.grad(lambda p, b: loss(nnx.merge(graphdef, p, rest), b)))
    grads = []
    for local in (jax.tree.map(lambda x, r=r: np.split(x, DP)[r], global_batch) for r in range(DP)):
        for j in range(MICRO):
            micro = jax.tree.map(lambda x, j=j: np.split(x, MICRO)[j], local)
            grads.append([np.asarray(g, np.float64) for g in jax.tree.leaves(grad(params, micro))])
    mean = [sum(gs) / len(gs) for gs in zip(*grads, strict=True)]
    return float(np.sqrt(sum(np.sum(g**2) for g in mean)))


@pytest.mark.parametrize("zero1", [False, True], ids=["ddp", "zero1"])
def test_accumulated_bfloat16_gradients_reduced_in_float32_keep_float32_precision(zero1):
    data = batch()
    strategy = DDP(cpu_mesh((DP,), ("dp",)), zero1=zero1, accumulation_steps=MICRO, reduce_dtype=jnp.float32)
    run = strategy.prepare(Bf16MLP(nnx.Rngs(0)), optax.sgd(0.1), loss, data)
    _, metrics = run.step(run.state, data)
    np.testing.assert_allclose(float(metrics["grad_norm"]), reference_norm(data), rtol=2e-6)
