"""An asynchronous save holds the values of its step on the layouts whose canonical form is the state
itself (plain DDP: `jit` may hand the state's own buffers back as the canonical arrays) or a
resharding of it (ZeRO-3): the next step donates the state while the save is still writing. The
reference is a host copy taken before the next step."""

import jax
import numpy as np
import pytest
from support.layouts import LAYOUTS, OPTIMIZER, batches, make_model

from jaxdist.train.checkpoint import Checkpoints


@pytest.mark.parametrize("layout", ["ddp8"])  # the layout whose canonical arrays may be the state's own
def test_the_saved_values_are_the_steps_while_the_next_steps_donate_the_state(tmp_path, layout):
    data = batches(3)
    # the checkpoint layout as test_canonical trains it: its program, compiled once per test run
    run = LAYOUTS[layout](make_model(), OPTIMIZER, data[0])
    state, _ = run.step(run.state, data[0])
    canonical = run.canonical(state)
    expected = jax.tree.map(np.asarray, canonical)
    ckpt = Checkpoints(tmp_path, keep=3)
    ckpt.save(1, canonical, {})
    for batch in data[1:]:  # donate and overwrite the state's buffers while step 1 is written
        state, _ = run.step(state, batch)
    ckpt.save(3, run.canonical(state), {})
    ckpt.wait()
    restored = ckpt.restore(1, run.canonical_target())
    ckpt.close()
    assert int(restored.step) == 1
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
