"""Gradients of bfloat16 reduced as the options say, checked against float64 numpy of the gradients
one device computes in bfloat16.

With `reduce_dtype=float32` (reduce in float32 to keep the gradient's precision), DDP's accumulation
(bfloat16 parameters) and the pipeline's micro-batches (`compute_dtype=bfloat16`) summed the
micro-batch gradients in bfloat16 before the float32 reduction, and the pipeline also averaged its
stage gradients over the data ranks in bfloat16 (norms 2.4e-4 and 3.9e-4 off, where float32 is
exact to 1e-8). DDP's `average_in_collective=False` pre-scaled by 1/dp rounded to bfloat16.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.models import ODD_UNITS, OddMLP, odd_batches, odd_loss

from jaxdist.ddp.run import DDP
from jaxdist.pipeline.run import Pipelined

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


def reference_norm(model, loss_fn, global_batch, ranks: int, micro: int) -> float:
    """The norm of the mean, in float64, of every (rank, micro-batch)'s gradient on one device, its
    parameters cast to bfloat16 (a bfloat16 gradient, widened by the cast's transpose where they are
    float32)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def half(p):
        return jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)

    grad = jax.jit(jax.grad(lambda p, b: loss_fn(nnx.merge(graphdef, half(p), rest), b)))
    grads = []
    for local in (jax.tree.map(lambda x, r=r: np.split(x, ranks)[r], global_batch) for r in range(ranks)):
        for j in range(micro):
            part = jax.tree.map(lambda x, j=j: np.split(x, micro)[j], local)
            grads.append([np.asarray(g, np.float64) for g in jax.tree.leaves(grad(params, part))])
    mean = [sum(gs) / len(gs) for gs in zip(*grads, strict=True)]
    return float(np.sqrt(sum(np.sum(g**2) for g in mean)))


@pytest.mark.parametrize("zero1", [False, True], ids=["ddp", "zero1"])
def test_accumulated_bfloat16_gradients_reduced_in_float32_keep_float32_precision(zero1):
    data = batch()
    strategy = DDP(cpu_mesh((DP,), ("dp",)), zero1=zero1, accumulation_steps=MICRO, reduce_dtype=jnp.float32)
    run = strategy.prepare(Bf16MLP(nnx.Rngs(0)), optax.sgd(0.1), loss, data)
    _, metrics = run.step(run.state, data)
    want = reference_norm(Bf16MLP(nnx.Rngs(0)), loss, data, DP, MICRO)
    np.testing.assert_allclose(float(metrics["grad_norm"]), want, rtol=2e-6)


def test_pipeline_microbatches_of_bfloat16_compute_reduced_in_float32_keep_float32_precision():
    data = odd_batches(1, rows=64)[0]

    def make():
        return OddMLP(nnx.Rngs(0), layers=4)

    strategy = Pipelined(
        cpu_mesh((2, 4), ("pp", "dp")), microbatches=4, compute_dtype=jnp.bfloat16, reduce_dtype=jnp.float32
    )
    run = strategy.prepare(make(), optax.sgd(0.1), ODD_UNITS, data)
    _, metrics = run.step(run.state, data)
    np.testing.assert_allclose(float(metrics["grad_norm"]), reference_norm(make(), odd_loss, data, 4, 4), rtol=2e-6)


def test_ddp_pre_scaling_by_one_over_dp_adds_no_bias_in_bfloat16():
    """`average_in_collective=False` scales by 1/dp, then sums. 1/3 rounded to bfloat16 (0.33398) scaled
    every gradient up by the same 0.14% (grad_norm +1.4e-3); scaled in float32 and rounded once, the
    error is bfloat16 rounding (1.5e-4 here, as the mean in the collective's 1.9e-4). Every rank holds
    the same rows, so the mean over ranks is one rank's gradient: one device's on those rows."""
    rng = np.random.default_rng(0)
    rows = {"x": rng.normal(size=(8, 8)).astype(np.float32), "y": rng.normal(size=(8, 4)).astype(np.float32)}
    data = jax.tree.map(lambda x: np.concatenate([x] * 3), rows)
    want = reference_norm(Bf16MLP(nnx.Rngs(0)), loss, rows, 1, 1)
    strategy = DDP(cpu_mesh((3,), ("dp",)), average_in_collective=False)
    run = strategy.prepare(Bf16MLP(nnx.Rngs(0)), optax.sgd(0.1), loss, data)
    _, metrics = run.step(run.state, data)
    np.testing.assert_allclose(float(metrics["grad_norm"]), want, rtol=5e-4)
