"""Save after 3 steps in one layout, restore onto another, train 3 more: the losses and final
parameters are those of an uninterrupted 6-step run in the second layout, so the Adam moments and the
step count (bias correction, the learning-rate schedule) survived the change of layout.

Pairs run (a chain: every layout once as source and once as target, plus same-layout resumes):
ddp8 -> zero1-8 -> fsdp8 -> hsdp2x4 -> dp4xtp2 -> fsdp-tp2x2x2 -> one -> ddp8, and every layout
onto itself (bit-exact).

Tolerances: losses rtol 1e-5, parameters atol 1e-4 per element (tests/support/reference.py): two layouts
differ by float32 rounding (means of per-device means, partial products summed over tp) only.
"""

import jax
import numpy as np
import pytest
from support.layouts import DATA, SPLIT, Trained
from support.reference import assert_params_close

CHAIN = ["ddp8", "zero1-8", "fsdp8", "hsdp2x4", "dp4xtp2", "fsdp-tp2x2x2", "one"]
PAIRS = [(a, b) for a, b in zip(CHAIN, CHAIN[1:] + CHAIN[:1], strict=True)]
SAME = [(a, a) for a in [*CHAIN, "engine-zero1-8"]]  # every layout resumed onto itself


def resumed(source: Trained, target: Trained, reset_optimizer: bool = False):
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
def test_restore_onto_another_layout_continues_its_uninterrupted_run(trained_layouts, source, target):
    losses, params = resumed(trained_layouts(source), trained_layouts(target))
    np.testing.assert_allclose(losses, trained_layouts(target).losses[SPLIT:], rtol=1e-5)
    assert_params_close(params, trained_layouts(target).final)


@pytest.mark.parametrize(("source", "target"), SAME, ids=[f"{a}->{b}" for a, b in SAME])
def test_same_layout_resume_is_bit_exact(trained_layouts, source, target):
    losses, params = resumed(trained_layouts(source), trained_layouts(target))
    assert losses == trained_layouts(target).losses[SPLIT:]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(trained_layouts(target).final), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_restarted_optimizer_would_be_caught(trained_layouts):
    """The comparison above can fail: the same restore with the Adam moments zeroed misses the reference."""
    losses, _ = resumed(trained_layouts("ddp8"), trained_layouts("zero1-8"), reset_optimizer=True)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(losses, trained_layouts("zero1-8").losses[SPLIT:], rtol=1e-5)
