"""Save after 3 steps in one layout, restore onto another, train 3 more: the losses and final
parameters are those of an uninterrupted 6-step run in the second layout, so the Adam moments and the
step count (bias correction, the learning-rate schedule) survived the change of layout.

Pairs run (a chain: every layout once as source and once as target, plus same-layout resumes):
ddp8 -> zero1-8 -> fsdp8 -> hsdp2x4 -> dp4xtp2 -> fsdp-tp2x2x2 -> one -> ddp8, and
dp4xtp2 -> dp4xtp2, zero1-8 -> zero1-8 (bit-exact).

Tolerances: losses rtol 1e-5, parameters atol 1e-4 per element (tests/test_ddp.py's): two layouts
differ by float32 rounding (means of per-device means, partial products summed over tp) only.
"""

import jax
import numpy as np
import optax
import pytest
from layouts import LAYOUTS, batches, make_model
from test_ddp import assert_params_close

from jaxdist.train.checkpoint import Checkpoints

SPLIT, STEPS = 3, 6
CHAIN = ["ddp8", "zero1-8", "fsdp8", "hsdp2x4", "dp4xtp2", "fsdp-tp2x2x2", "one"]
PAIRS = [(a, b) for a, b in zip(CHAIN, CHAIN[1:] + CHAIN[:1], strict=True)]
SAME = [("dp4xtp2", "dp4xtp2"), ("zero1-8", "zero1-8")]
# a schedule, so a step count that did not survive shows in the learning rate
OPTIMIZER = optax.adamw(optax.linear_schedule(1e-2, 1e-3, STEPS), weight_decay=0.1)
DATA = batches(STEPS)


class Layout:
    """One layout's prepared run, its uninterrupted 6-step losses and parameters, and a checkpoint of step 3."""

    def __init__(self, name: str, directory):
        self.run = LAYOUTS[name](make_model(), OPTIMIZER, DATA[0])
        self.ckpt = Checkpoints(directory, keep=1)
        state, self.losses = self.run.state, []
        for i, batch in enumerate(DATA):
            state, metrics = self.run.step(state, batch)
            self.losses.append(float(metrics["loss"]))
            if i + 1 == SPLIT:
                self.ckpt.save(SPLIT, self.run.canonical(state), {"layout": name})
        self.ckpt.wait()
        self.final = self.run.canonical(state).params


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    made = {}

    def get(name: str) -> Layout:
        if name not in made:
            made[name] = Layout(name, tmp_path_factory.mktemp(name))
        return made[name]

    yield get
    for layout in made.values():
        layout.ckpt.close()


def resumed(source: Layout, target: Layout, reset_optimizer: bool = False):
    run = target.run
    canonical = source.ckpt.restore(SPLIT, run.canonical_target())
    if reset_optimizer:
        canonical.opt_state = jax.tree.map(lambda x: x * 0, canonical.opt_state)
    state, losses = run.from_canonical(canonical), []
    assert int(state.step) == SPLIT
    for batch in DATA[SPLIT:]:
        state, metrics = run.step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, run.canonical(state).params


@pytest.mark.parametrize(("source", "target"), PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_restore_onto_another_layout_continues_its_uninterrupted_run(layouts, source, target):
    losses, params = resumed(layouts(source), layouts(target))
    np.testing.assert_allclose(losses, layouts(target).losses[SPLIT:], rtol=1e-5)
    assert_params_close(params, layouts(target).final)


@pytest.mark.parametrize(("source", "target"), SAME, ids=[f"{a}->{b}" for a, b in SAME])
def test_same_layout_resume_is_bit_exact(layouts, source, target):
    losses, params = resumed(layouts(source), layouts(target))
    assert losses == layouts(target).losses[SPLIT:]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(layouts(target).final), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_restarted_optimizer_would_be_caught(layouts):
    """The comparison above can fail: the same restore with the Adam moments zeroed misses the reference."""
    losses, _ = resumed(layouts("ddp8"), layouts("zero1-8"), reset_optimizer=True)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(losses, layouts("zero1-8").losses[SPLIT:], rtol=1e-5)
