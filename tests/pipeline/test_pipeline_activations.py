"""A pipeline stage keeping its forward's residuals (the default) or recomputing them (remat=True).

Checked on the compiled step: keeping, a step runs plain autodiff's matmuls (no second forward),
also with the backward split into B and W (ZB-H1: W does not replay B's chain); recomputing adds
the replayed forward's. Keeping under 1F1B and ZB-H1, the compiled temporary memory does not grow
with the micro-batch count (at most pp micro-batches hold residuals), while GPipe's does. The
training math of both modes: tests/pipeline/test_pipeline.py's parity cases.
"""

import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.models import MLP_UNITS, ResMLP

from jaxdist.pipeline.run import Pipelined

D, F, ROWS = 128, 256, 64  # per micro-batch


def _compile(schedule: str, microbatches: int, layers: int, remat=None):
    """(compiled temp bytes, matmuls, the run's tick plan) of one pp=2 step at a fixed micro-batch size."""
    rng = np.random.default_rng(1)
    n = ROWS * microbatches
    batch = {"x": rng.normal(size=(n, 5)).astype(np.float32), "y": rng.normal(size=(n, 6)).astype(np.float32)}
    strategy = Pipelined(cpu_mesh((2,), ("pp",)), microbatches=microbatches, schedule=schedule, remat=remat)
    run = strategy.prepare(ResMLP(nnx.Rngs(0), d=D, f=F, layers=layers), optax.sgd(0.1), MLP_UNITS, batch)
    compiled = run.step.lower(run.state, batch).compile()
    dots = sum(1 for line in compiled.as_text().splitlines() if " dot(" in line)
    return compiled.memory_analysis().temp_size_in_bytes, dots, run.plan


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_kept_activations_run_plain_autodiffs_matmuls_and_no_second_forward(schedule):
    """The step's program holds each table entry once (a branch of the tick's switch). Plain autodiff
    of the ResMLP with n blocks: forward 2 per block, the embed 1, the head 1; backward 4 per block
    (input and weight gradients of 2 layers), the embed's weight gradient 1, the head 2: 6 n + 5.
    Kept, the stages' branches together run exactly those; recomputed, each stage's B replays its
    forward as far as backward needs it: of its k = 2 blocks every layer but the last block's second
    (whose output nothing reads), 2 k - 1, and on the first stage the embed: 4 k - 1 in all. Under
    ZB-H1 each stage's W replays it again."""
    layers, k = 4, 2
    _, kept, _ = _compile(schedule, 4, layers)
    _, recomputed, _ = _compile(schedule, 4, layers, remat=True)
    assert kept == 6 * layers + 5, kept
    replays = (4 * k - 1) * (2 if schedule == "zb-h1" else 1)
    assert recomputed == kept + replays, (kept, recomputed)


def test_kept_activations_do_not_grow_with_the_microbatch_count_under_1f1b_and_zb_h1():
    """Doubling the micro-batches (same micro-batch size) adds no memory under 1F1B and ZB-H1 (pp
    residual slots, and for ZB-H1 pp slots of W's output gradients)."""
    activation = ROWS * D * 4
    temp, plans = {}, {}
    for schedule in ("1f1b", "zb-h1"):
        for m in (4, 8):
            # 4 blocks: at 4 micro-batches, the kept programs of the matmul test above (compiled once)
            temp[schedule, m], _, plans[schedule, m] = _compile(schedule, m, 4)
        assert plans[schedule, 4].slots == plans[schedule, 8].slots
        assert plans[schedule, 8].res_slots == 2
        assert abs(temp[schedule, 8] - temp[schedule, 4]) < activation / 8, temp
    assert plans["zb-h1", 8].slots["cot"] == 2


# two more compiles: with the slow tests (the contrast that shows the measure above sees a growth)
@pytest.mark.slow
def test_gpipe_keeps_every_microbatchs_activations():
    """GPipe keeps every micro-batch's residuals: doubling 4 micro-batches to 8 adds 4, each more than one
    activation of 64 x 128 floats."""
    activation = ROWS * D * 4
    (temp4, _, _), (temp8, _, plan8) = _compile("gpipe", 4, 4), _compile("gpipe", 8, 4)
    assert plan8.res_slots == 8
    assert temp8 - temp4 >= 4 * activation, (temp4, temp8)


def test_the_split_backward_runs_each_equation_once_and_matches_autodiff():
    """B's input gradient and W's weight gradient equal `jax.vjp`'s; B and W together run the
    backward's matmuls once (W reads the layers' output gradients B computed: the LayerNorm's scale
    needs the gradient at the norm's output, which W does not recompute)."""
    import jax
    import jax.numpy as jnp

    from jaxdist.pipeline.backward_split import SplitBackward

    def layer(w, x):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        h = (x - mu) / jnp.sqrt(var + 1e-6) * w["scale"]
        return x + jax.nn.relu(h @ w["up"]) @ w["down"]

    def bwd(w, res, dy, side):
        _, vjp = jax.vjp(layer, w, res["x"])
        return vjp(dy * side)

    rng = np.random.default_rng(0)
    w = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in (("scale", 8), ("up", (8, 16)), ("down", (16, 8)))}
    x, dy, side = (jnp.asarray(rng.normal(size=(4, 8)), jnp.float32) for _ in range(3))
    split = SplitBackward(bwd, w, {"x": x}, dy, side)
    dx, boundary = split.input_gradient(w, {"x": x}, dy, side)
    dw = split.weight_gradient(w, {"x": x}, boundary, side)
    ref_dw, ref_dx = bwd(w, {"x": x}, dy, side)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-6)
    for k in w:
        np.testing.assert_allclose(dw[k], ref_dw[k], rtol=1e-6)

    def dots(indices):
        return sum(split.jaxpr.eqns[i].primitive.name == "dot_general" for i in indices)

    total = sum(e.primitive.name == "dot_general" for e in split.jaxpr.eqns)
    # the vjp's 2 forward, 2 input-gradient and 2 weight-gradient matmuls: B the first forward one (the
    # relu's mask; the second's output is y, which backward does not read) and the input gradient's
    assert (dots(split.b_eqns), dots(split.w_eqns), total) == (3, 2, 6)
