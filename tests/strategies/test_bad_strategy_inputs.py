"""Bad input to the strategies' public API raises one clear error naming the problem and the fix,
before anything runs: a model with nothing to train, a DDP loss that is not a scalar, one mesh axis
named for two roles, a tp plan with a column layer but no row layer after it."""

import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.models import ODD_UNITS, OddMLP, odd_batches, odd_loss

from jaxdist.ddp.run import DDP
from jaxdist.engine.fsdp import FSDP
from jaxdist.engine.run import Parallel, Units
from jaxdist.pipeline.run import Pipelined
from jaxdist.tp import plan as tp_plan

BATCH = odd_batches(1)[0]


class Frozen(nnx.Module):
    """Weights declared as nnx.Variable: state the step carries, nothing it trains."""

    def __init__(self):
        self.w = nnx.Variable(jnp.ones((5, 3)))

    def __call__(self, x):
        return x @ self.w[...]


class FrozenBlocks(nnx.Module):
    def __init__(self):
        self.layers = nnx.List([Frozen(), Frozen()])


def frozen_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


SQUARE = Units(embed=lambda m, b: b["y"], head_loss=lambda m, x, b: jnp.mean(x**2), blocks="layers")
# the blocks map 5 features to 3: the test never gets that far


def test_a_model_without_parameters_is_refused_not_trained_silently():
    # before: DDP and the engine ran such a model and reported a loss and grad_norm 0, training nothing
    with pytest.raises(ValueError, match="DDP: the model has no nnx.Param, so nothing would train"):
        DDP(cpu_mesh((8,), ("dp",))).prepare(Frozen(), optax.sgd(0.1), frozen_loss, BATCH)
    strategies = {
        "Parallel": Parallel(cpu_mesh((8,), ("fsdp",))),
        "Parallel ": FSDP(cpu_mesh((2, 4), ("dp", "fsdp")), dp_axis="dp"),  # FSDP prepares a Parallel
        "Pipelined": Pipelined(cpu_mesh((2, 4), ("pp", "dp")), microbatches=2),
    }
    for who, strategy in strategies.items():
        with pytest.raises(ValueError, match=f"{who.strip()}: the model has no nnx.Param.*declare the trained"):
            strategy.prepare(FrozenBlocks(), optax.sgd(0.1), SQUARE, BATCH)


@pytest.mark.parametrize(
    "loss_fn, match",
    [
        (lambda m, b: (m(b["x"]) - b["y"]) ** 2, r"loss_fn must return a scalar mean loss, got .*shape=\(2, 3\)"),
        (lambda m, b: (odd_loss(m, b), {"n": 1}), "scalar mean loss; for a \\(sum, count\\) pair pass sum_and_count"),
    ],
    ids=["per-example", "tuple"],
)
def test_a_ddp_loss_that_is_not_a_scalar_is_a_clear_error(loss_fn, match):
    with pytest.raises(ValueError, match=match):
        DDP(cpu_mesh((8,), ("dp",))).prepare(OddMLP(nnx.Rngs(0)), optax.sgd(0.1), loss_fn, BATCH)


def test_one_mesh_axis_named_for_two_roles_is_a_clear_error():
    # before: "batch leading dimension 16 must be divisible by the 64 devices of the data axes ('x', 'x')"
    mesh = cpu_mesh((8,), ("x",))
    with pytest.raises(
        ValueError, match="Parallel: dp_axis='x', fsdp_axis='x', tp_axis='tp', cp_axis='cp' name one axis twice"
    ):
        Parallel(mesh, dp_axis="x", fsdp_axis="x")
    with pytest.raises(ValueError, match="pp_axis='x' name one axis twice"):
        Pipelined(cpu_mesh((2, 4), ("x", "dp")), fsdp_axis="x", pp_axis="x")
    with pytest.raises(ValueError, match="FSDP: dp_axis='x' is axis itself"):
        FSDP(mesh, axis="x", dp_axis="x")
    run = Parallel(mesh, fsdp_axis="x").prepare(OddMLP(nnx.Rngs(0)), optax.sgd(0.1), ODD_UNITS, BATCH)
    assert run.cfg.storage_axis == "x"  # one role on a renamed axis is fine


def test_a_column_layer_without_its_row_is_a_clear_error():
    """A plan placing `up` column but nothing on `down`: the replicated `down` gets one rank's features.
    Before: "dot_general requires contracting dimensions to have the same shape" from inside the model."""
    plan = tp_plan.TPPlan({"layers/*/up": tp_plan.column()})
    strategy = Parallel(cpu_mesh((4, 2), ("dp", "tp")), plan=plan)
    match = r"TPPlan: layers/0/down \(replicated: the plan places no rule on it\) gets 3 input features .* \(tp=2\)"
    with pytest.raises(ValueError, match=match):
        strategy.prepare(OddMLP(nnx.Rngs(0), hidden=6, d=8), optax.sgd(0.1), ODD_UNITS, BATCH)
