"""Restoring onto a sharded layout never holds a whole copy on a device: orbax reads each array into
the target's canonical shardings (each device reads its shard), and the conversion to the run's own
layout (from_canonical) is a resharding whose buffers are per-device shares.

Measured on the tiny GPT with Adam (state 361,736 bytes; 1/8 = 45,217; the layouts' scheduled AdamW used
here adds a 4-byte count): FSDP over 8 converts with
arguments 45,224 / outputs 45,960 / temporaries 0 bytes per device; FSDP x TP 2x2x2 (state split 4
ways, replicated over dp) 93,320 / 94,056 / 19,204 (the fused q/k/v reorder, on shares).
"""

import jax
import numpy as np
import pytest
from support.layouts import LAYOUTS, OPTIMIZER, batches, make_model

from jaxdist.train.checkpoint import Checkpoints


def state_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def conversion_memory(run):
    target = run.canonical_target()
    return jax.jit(run._from_canonical, out_shardings=run.state_shardings).lower(target).compile().memory_analysis()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    data = batches(1)
    # the ddp8 checkpoint layout as test_canonical trains it (AdamW): its program, compiled once per test run
    run = LAYOUTS["ddp8"](make_model(), OPTIMIZER, data[0])
    state, _ = run.step(run.state, data[0])
    ckpt = Checkpoints(tmp_path_factory.mktemp("saved"), keep=1)
    ckpt.save(1, run.canonical(state), {})
    ckpt.wait()
    yield ckpt
    ckpt.close()


@pytest.mark.parametrize(("layout", "ways"), [("fsdp8", 8), ("fsdp-tp2x2x2", 4), ("zero1-8", 8)])
def test_restore_reads_and_converts_per_device_shares_only(saved, layout, ways):
    run = LAYOUTS[layout](make_model(), OPTIMIZER, batches(1)[0])
    total = state_bytes(run.canonical_target())
    share = total / ways
    restored = saved.restore(1, run.canonical_target())
    for device in run.mesh.devices.flat:  # what orbax put on each device
        held = sum(s.data.nbytes for x in jax.tree.leaves(restored) for s in x.addressable_shards if s.device == device)
        assert held <= 1.05 * share, (device, held, share)
    memory = conversion_memory(run)
    assert memory.argument_size_in_bytes <= 1.05 * share
    assert memory.output_size_in_bytes <= 1.05 * share
    assert memory.temp_size_in_bytes <= 0.25 * share  # no whole parameter: only shares being reordered
    state = run.from_canonical(restored)
    assert int(state.step) == 1
    np.testing.assert_array_equal(
        np.asarray(run.canonical(state).params["wte"]["embedding"]), np.asarray(restored.params["wte"]["embedding"])
    )


def test_the_measure_sees_a_whole_copy():
    """The control: a replicated layout (engine DP) does hold the whole state on every device."""
    run = LAYOUTS["engine-dp8"](make_model(), OPTIMIZER, batches(1)[0])
    assert conversion_memory(run).output_size_in_bytes >= state_bytes(run.canonical_target())
