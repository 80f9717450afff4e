"""An asynchronous save writes the values of the step it was given, although the next step donates
the state and the arrays handed to it are deleted before the write finishes."""

import time

import jax
import numpy as np
from support.layouts import LAYOUTS, OPTIMIZER, batches, make_model

from jaxdist.train.checkpoint import Checkpoints


def slow_down(monkeypatch, owner, name: str, seconds: float) -> None:
    """`owner.name` (a method) sleeps `seconds` before it runs: a slow disk, a slow deletion."""
    real = getattr(owner, name)

    def slowed(self, *args, **kwargs):
        time.sleep(seconds)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, slowed)


def test_the_saved_values_are_the_steps_even_when_its_buffers_are_donated_and_deleted(tmp_path):
    data = batches(2)
    # the zero1-8 checkpoint layout as test_canonical trains it: its program, compiled once per test run
    run = LAYOUTS["zero1-8"](make_model(), OPTIMIZER, data[0])
    state, _ = run.step(run.state, data[0])
    canonical = run.canonical(state)
    expected = jax.tree.map(np.asarray, canonical)
    ckpt = Checkpoints(tmp_path, keep=2)
    ckpt.save(1, canonical, {})
    state, _ = run.step(state, data[1])  # donates the state the canonical form came from
    for x in jax.tree.leaves(canonical):
        x.delete()
    ckpt.save(2, run.canonical(state), {})  # waits for save 1: one in flight at most
    assert ckpt.pending == 2
    ckpt.wait()
    assert ckpt.pending is None and ckpt.manager.all_steps() == [1, 2]
    restored = ckpt.restore(1, run.canonical_target())
    ckpt.close()
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_the_checksum_pass_runs_in_the_background_and_is_complete_after_wait(tmp_path, monkeypatch):
    """Reading a checkpoint back for its CRCs took the loop ~0.5 s per save when `wait` did it."""
    from jaxdist.train import checkpoint, checksums

    slow = 1.5
    slow_down(monkeypatch, checkpoint.Checkpoints, "_write_checksums", slow)
    ckpt = Checkpoints(tmp_path, keep=2)
    state = {"w": np.arange(1000, dtype=np.float32)}
    t = time.perf_counter()
    ckpt.save(1, state, {})
    assert time.perf_counter() - t < slow  # returned before the checksums were written
    ckpt.wait()
    assert time.perf_counter() - t >= slow
    assert (ckpt.directory / "1" / checksums.CHECKSUMS).is_file()
    ckpt.close()


def test_older_checkpoints_are_deleted_after_the_save_and_do_not_hold_it_up(tmp_path, monkeypatch):
    """Freeing an older checkpoint (0.2 s for 1.4 GiB in a tmpfs on a GPU host) is not part of the save
    that the loop's next save waits for; after `close` only the newest `keep` are left."""
    from orbax.checkpoint._src.path import deleter

    slow = 1.5
    slow_down(monkeypatch, deleter.StandardCheckpointDeleter, "delete", slow)
    ckpt = Checkpoints(tmp_path, keep=1)
    state = {"w": np.arange(1000, dtype=np.float32)}
    ckpt.save(1, state, {})
    ckpt.wait()
    t = time.perf_counter()
    ckpt.save(2, state, {})  # in place, it has checkpoint 1 deleted
    ckpt.wait()
    assert time.perf_counter() - t < slow
    ckpt.close()  # waits for the deletion
    assert sorted(p.name for p in ckpt.directory.iterdir()) == ["2"]


def test_uncompressed_by_default_and_older_compressed_checkpoints_still_restore(tmp_path):
    """Arrays are written without zstd unless asked (float32 state: ~8% larger, ~2x faster to
    write); a checkpoint saved by the previous format (orbax's StandardSave, compressed) restores."""
    import orbax.checkpoint as ocp

    state = {"w": np.zeros((256, 256), np.float32), "step": np.int32(7)}  # 256 KiB, all zeros
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_one_device()), state)
    for compress in (False, True):
        ckpt = Checkpoints(tmp_path / str(compress), keep=1, compress=compress)
        ckpt.save(1, state, {})
        ckpt.wait()
        item = ckpt.directory / "1" / ("state" if compress else "arrays")  # orbax's zstd form when compressed
        written = sum(f.stat().st_size for f in item.rglob("*") if f.is_file())
        assert written < 64 << 10 if compress else written > 256 << 10
        restored = ckpt.restore(1, target)
        ckpt.close()
        jax.tree.map(np.testing.assert_array_equal, restored, state)
    old_dir = tmp_path / "old" / "checkpoints"
    options = ocp.CheckpointManagerOptions(create=True)
    with ocp.CheckpointManager(old_dir, options=options, item_names=("state", "meta")) as old:
        old.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({})))
        old.wait_until_finished()
    ckpt = Checkpoints(tmp_path / "old", keep=1)
    jax.tree.map(np.testing.assert_array_equal, ckpt.restore(3, target), state)
    ckpt.close()


def _one_device():
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def test_warm_up_makes_one_host_copy_and_saves_nothing(tmp_path, monkeypatch):
    """The trainer warms the host copy before its loop (the first copy into pinned memory took 1.16 s
    of the loop's first save on an H200); the warm-up writes nothing and leaves the state usable."""
    from jaxdist.train import checkpoint

    copied = []
    real = checkpoint.start_host_copy

    def copy(tree, **options):
        copied.append(tree)
        return real(tree, **options)

    monkeypatch.setattr(checkpoint, "start_host_copy", copy)
    state = {"w": jax.numpy.arange(1000, dtype=np.float32), "step": jax.numpy.asarray(3)}
    ckpt = Checkpoints(tmp_path, keep=2)
    ckpt.warm_up(state)
    assert len(copied) == 1 and copied[0] is state
    assert ckpt.pending is None and ckpt.manager.all_steps() == [] and ckpt.latest() is None
    ckpt.save(1, state, {})  # the state is still whole: the warm-up copied it, it did not take it
    ckpt.wait()
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    restored = ckpt.restore(1, target)
    ckpt.close()
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(1000, dtype=np.float32))
