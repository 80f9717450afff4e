"""Same-layout resume is bit-exact (README: "Same-layout resume is bit-exact") on the layouts
tests/test_checkpoint_layouts.py does not resume onto themselves: plain DDP, the engine's ZeRO-3
(FSDP), HSDP, FSDP x TP and one device. The reference is each layout's own uninterrupted run
(tests/layouts.py: 6 steps of AdamW on a schedule, so the step count matters too)."""

import jax
import numpy as np
import pytest
from layouts import SPLIT
from test_checkpoint_layouts import resumed

SAME = ["ddp8", "fsdp8", "hsdp2x4", "fsdp-tp2x2x2", "engine-zero1-8", "one"]


@pytest.mark.parametrize("layout", SAME)
def test_same_layout_resume_is_bit_exact_on_every_layout(trained_layouts, layout):
    losses, params = resumed(trained_layouts(layout), trained_layouts(layout))
    assert losses == trained_layouts(layout).losses[SPLIT:]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(trained_layouts(layout).final), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
