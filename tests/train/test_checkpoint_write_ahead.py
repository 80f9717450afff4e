"""One process's saves write the array files into `checkpoints.writing/`, beside the checkpoints, from
before orbax's temporary directory exists; orbax's item handler then moves them in. Nothing there is ever
a checkpoint: a save's files end up in it, summed as written; a failed write leaves no checkpoint and no
files; an interrupted save's leftovers go at the next save."""

import errno
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist.train import arrays_handler, checksums
from jaxdist.train.checkpoint import CheckpointError, Checkpoints


def _state() -> dict:
    return {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.arange(5).astype(jnp.bfloat16), "step": jnp.int32(3)}


def _restores(ckpt: Checkpoints, step: int, state: dict) -> None:
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    restored = ckpt.restore(step, target)
    for name, value in state.items():
        got = np.asarray(restored[name])
        assert got.dtype == value.dtype and got.shape == value.shape, name
        np.testing.assert_array_equal(got, np.asarray(value), err_msg=name)


def test_a_saves_array_files_are_written_beside_the_checkpoints_then_moved_in(tmp_path, monkeypatch):
    where = []
    write = arrays_handler.write_arrays

    def noting_where(directory, tree, chunk_bytes):
        where.append(Path(directory))
        return write(directory, tree, chunk_bytes)

    monkeypatch.setattr(arrays_handler, "write_arrays", noting_where)
    ckpt = Checkpoints(tmp_path, keep=2)
    state = _state()
    ckpt.save(1, state, {"step": 1})
    ckpt.wait()
    assert where == [ckpt.writing_dir] and not ckpt.writing_dir.exists()
    assert list((ckpt.directory / "1" / "arrays").glob("arrays.*.safetensors"))
    checksums.verify(ckpt.directory / "1")  # the files moved in are the ones summed as written
    _restores(ckpt, 1, state)
    ckpt.close()


def test_an_interrupted_saves_leftovers_are_no_checkpoint_and_go_at_the_next_save(tmp_path):
    ckpt = Checkpoints(tmp_path, keep=2)
    ckpt.writing_dir.mkdir(parents=True)
    (ckpt.writing_dir / "arrays.0.0.safetensors").write_bytes(b"the first bytes of a killed save")
    (ckpt.writing_dir / "arrays.0.7.safetensors").write_bytes(b"a file this save does not write")
    assert ckpt.latest() is None
    state = _state()
    ckpt.save(1, state, {"step": 1})
    ckpt.wait()
    assert ckpt.latest() == 1 and not ckpt.writing_dir.exists()
    assert not (ckpt.directory / "1" / "arrays" / "arrays.0.7.safetensors").exists()
    checksums.verify(ckpt.directory / "1")
    _restores(ckpt, 1, state)
    ckpt.close()


def test_a_write_that_fails_leaves_no_checkpoint_and_no_files(tmp_path, monkeypatch):
    def disk_full(directory, tree, chunk_bytes):
        (Path(directory) / "arrays.0.0.safetensors").write_bytes(b"half a file")
        raise OSError(errno.ENOSPC, "No space left on device")

    ckpt = Checkpoints(tmp_path, keep=2)
    state = _state()
    ckpt.save(1, state, {"step": 1})
    ckpt.wait()
    monkeypatch.setattr(arrays_handler, "write_arrays", disk_full)
    ckpt.save(2, state, {"step": 2})
    with pytest.raises(CheckpointError, match="free some space"):
        ckpt.wait()
    assert not ckpt.writing_dir.exists()
    assert sorted(p.name for p in ckpt.directory.iterdir()) == ["1"]  # no temporary directory of step 2
    monkeypatch.undo()
    ckpt = Checkpoints(tmp_path, keep=2)
    assert ckpt.latest() == 1
    _restores(ckpt, 1, state)
    ckpt.close()
