"""`skip_nonfinite` when one data rank alone sees a NaN (one row of its batch): every rank skips the
same step, and the state (parameters, Adam's moments and count, BatchNorm statistics, RNG streams)
is left bit for bit as it was, under ZeRO-1 with accumulation, HSDP x TP, and the pipeline; the
next clean step trains again."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.models import NET_UNITS as UNITS
from support.models import ODD_UNITS, Net, OddMLP, net_loss, odd_batches
from support.models import net_batches as data

from jaxdist.ddp.run import DDP
from jaxdist.engine.run import Parallel
from jaxdist.pipeline.run import Pipelined
from jaxdist.tp import plan as tp_plan


def with_batchnorm():
    return Net([1.0, 0.5], nnx.Rngs(0, dropout=3), batchnorm=True, dropout=0.1)


CASES = {
    "zero1-accumulate": lambda: DDP(cpu_mesh((4,), ("dp",)), zero1=True, accumulation_steps=2).prepare(
        with_batchnorm(), optax.adam(1e-2), net_loss, data(1)[0]
    ),
    "dp2xfsdp2xtp2": lambda: Parallel(
        cpu_mesh((2, 2, 2), ("dp", "fsdp", "tp")),
        plan=tp_plan.TPPlan({"blocks/*/lin": tp_plan.column(gather_output=True)}),
    ).prepare(with_batchnorm(), optax.adam(1e-2), UNITS, data(1)[0]),
    "pp2xdp4": lambda: Pipelined(cpu_mesh((2, 4), ("pp", "dp")), microbatches=2).prepare(
        OddMLP(nnx.Rngs(0), layers=4), optax.adam(1e-2), ODD_UNITS, odd_batches(1)[0]
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_a_nan_on_one_rank_skips_the_step_everywhere_and_changes_nothing(name):
    run = CASES[name]()
    clean = data(3) if name != "pp2xdp4" else odd_batches(3)
    poisoned = {k: v.copy() for k, v in clean[1].items()}
    poisoned["x"][-3, 1] = np.nan  # a row of the last data rank only
    state, first = run.step(run.state, clean[0])
    before = jax.tree.map(np.asarray, (state.params, state.opt_state, state.model_state))
    state, bad = run.step(state, poisoned)
    assert bool(bad["skipped"]) and not np.isfinite(float(bad["grad_norm"]))
    after = jax.tree.map(np.asarray, (state.params, state.opt_state, state.model_state))
    if name != "pp2xdp4":  # (the pipeline takes no model state yet)
        assert jax.tree.leaves(before[2])  # statistics and RNG streams are part of the check
    for b, a in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(b, a)  # bit for bit, on every shard
    state, good = run.step(state, clean[2])
    assert not bool(first["skipped"]) and not bool(good["skipped"]) and np.isfinite(float(good["loss"]))
    moved = jax.tree.map(np.asarray, state.params)
    assert any(
        not np.array_equal(b, a) for b, a in zip(jax.tree.leaves(before[0]), jax.tree.leaves(moved), strict=True)
    )


def _nan_loss_where_flagged(head_loss):
    """The loss made NaN for a batch with a flagged row, its gradient left finite (a `jnp.where` on it)."""

    def loss(model, *args):
        batch = args[-1]
        flagged = jax.numpy.any(batch["flag"] > 0)
        return head_loss(model, *args) + jax.lax.stop_gradient(jax.numpy.where(flagged, jax.numpy.nan, 0.0))

    return loss


LOSS_ONLY_CASES = {
    "ddp": lambda b: DDP(cpu_mesh((4,), ("dp",))).prepare(
        Net([1.0, 0.5], nnx.Rngs(0)), optax.sgd(0.1), _nan_loss_where_flagged(net_loss), b
    ),
    "dp2xfsdp4": lambda b: Parallel(cpu_mesh((2, 4), ("dp", "fsdp"))).prepare(
        Net([1.0, 0.5], nnx.Rngs(0)),
        optax.sgd(0.1),
        type(UNITS)(UNITS.embed, _nan_loss_where_flagged(UNITS.head_loss)),
        b,
    ),
}


@pytest.mark.parametrize("name", LOSS_ONLY_CASES)
def test_a_nan_loss_with_a_finite_gradient_skips_the_step_too(name):
    """The docs say a step whose loss or gradient is not finite is skipped; a NaN loss whose gradient was
    finite trained on (its row said loss null, skipped false)."""
    clean = [{**b, "flag": np.zeros(len(b["x"]), np.float32)} for b in data(2)]
    run = LOSS_ONLY_CASES[name](clean[0])
    poisoned = {**clean[1], "flag": np.eye(1, len(clean[1]["x"]), len(clean[1]["x"]) - 1, np.float32)[0]}
    state, _ = run.step(run.state, clean[0])
    before = jax.tree.map(np.asarray, state.params)
    state, bad = run.step(state, poisoned)
    assert bool(bad["skipped"]) and np.isnan(float(bad["loss"])) and np.isfinite(float(bad["grad_norm"]))
    for b, a in zip(jax.tree.leaves(before), jax.tree.leaves(jax.tree.map(np.asarray, state.params)), strict=True):
        np.testing.assert_array_equal(b, a)
