"""A step's batch need not have the example batch's size: every strategy trains on it as one
device does, and a batch that does not split as the strategy needs is a clear error, not a shape
error from deep inside JAX.

`prepare` takes an example batch (for shapes); the trainer then steps with batches of that size,
but a user's own loop may not (a last, smaller batch; a larger one after a warm-up).
"""

import jax
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.models import ODD_UNITS, OddMLP, odd_batches, odd_loss
from support.reference import assert_same_training, train_single_device
from support.runs import train

from jaxdist.ddp.run import DDP
from jaxdist.engine.run import Parallel
from jaxdist.pipeline.run import Pipelined

SMALL, LARGE = odd_batches(1, rows=16)[0], odd_batches(1, rows=32, seed=9)[0]

STRATEGIES = {
    "ddp": lambda: DDP(cpu_mesh((8,), ("dp",))),
    "ddp-zero1": lambda: DDP(cpu_mesh((8,), ("dp",)), zero1=True),
    "ddp-accumulation": lambda: DDP(cpu_mesh((4,), ("dp",)), zero1=True, accumulation_steps=2),
    "hsdp": lambda: Parallel(cpu_mesh((2, 4), ("dp", "fsdp"))),
    "pipeline": lambda: Pipelined(cpu_mesh((2, 4), ("pp", "dp")), microbatches=2),
}


def prepare(name, model, optimizer, batch):
    strategy = STRATEGIES[name]()
    how = odd_loss if isinstance(strategy, DDP) else ODD_UNITS
    return strategy.prepare(model, optimizer, how, batch)


def make():
    return OddMLP(nnx.Rngs(0), layers=2)


@pytest.fixture(scope="module")
def one_device():
    """The single-device run every strategy is compared with, trained once."""
    return train_single_device(make, odd_loss, [SMALL, LARGE, SMALL], optax.sgd(0.2, momentum=0.9))


# plain DDP is slow: ZeRO-1 runs DDP's per-device step in the fast run (ddp-zero1, ddp-accumulation)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow if n == "ddp" else ()) for n in STRATEGIES])
def test_a_step_batch_of_another_size_trains_as_one_device(one_device, name):
    """Prepared on 16 rows, stepped on 16, then 32: SGD with momentum as on one device."""
    opt = optax.sgd(0.2, momentum=0.9)
    data = [SMALL, LARGE, SMALL]
    assert_same_training(train(prepare(name, make(), opt, SMALL), data), one_device)


@pytest.mark.parametrize(
    ("name", "rows", "match"),
    [
        ("ddp-accumulation", 12, "divisible by dp \\* accumulation_steps = 8"),
        ("hsdp", 12, "divisible by the 8 devices of the data axes"),
        ("pipeline", 24, "6 rows do not split into microbatches=4"),
    ],
)
def test_a_step_batch_that_does_not_split_is_a_clear_error(name, rows, match):
    run = prepare(name, OddMLP(nnx.Rngs(0), layers=2), optax.sgd(0.1), SMALL)
    if name == "pipeline":
        run = Pipelined(cpu_mesh((2, 4), ("pp", "dp")), microbatches=4).prepare(
            OddMLP(nnx.Rngs(0), layers=2), optax.sgd(0.1), ODD_UNITS, SMALL
        )
    with pytest.raises(ValueError, match=match):
        run.step(run.state, odd_batches(1, rows=rows)[0])
    jax.block_until_ready(run.state.params)  # the state was not donated to a failed step


@pytest.mark.parametrize("name", ["ddp-zero1", "hsdp", "pipeline"])
def test_batch_leaves_of_different_sizes_are_a_clear_error_at_prepare_and_at_step(name):
    """16 rows of x against 8 of y used to split evenly per rank (2 against 1) and broadcast: a step
    that trained silently on mismatched rows, where one device fails."""
    mismatched = {**SMALL, "y": SMALL["y"][:8]}
    match = "the batch's leaves disagree on the batch size .*'x' has 16, 'y' has 8"
    with pytest.raises(ValueError, match=match):
        prepare(name, make(), optax.sgd(0.1), mismatched)
    run = prepare(name, make(), optax.sgd(0.1), SMALL)
    with pytest.raises(ValueError, match=match):
        run.step(run.state, mismatched)
