"""A full disk while writing a checkpoint, an export or prepared data stops on one line that says
"no space left on device (PATH)" (not tensorstore's RESOURCE_EXHAUSTED text), leaving no partial output."""

import errno
import os
import subprocess
import uuid

import numpy as np
import pytest

from jaxdist.train.checkpoint import CheckpointError, Checkpoints

# what tensorstore raises through orbax when a write finds the disk full
TENSORSTORE_FULL = (
    'RESOURCE_EXHAUSTED: Error writing "params.w/0" in OCDBT database at local file "/x/ocdbt.process_0/": '
    'Failed writing: "/x/ocdbt.process_0/d/0": Failed to write 450768 bytes to file 11: No space left on device '
    "[os_error_code='28']"
)
STATE = {"params": {"w": np.arange(1 << 16, dtype=np.float32)}}  # 256 KiB


def _check_one_line(message: str, path) -> None:
    assert f"no space left on device ({path})" in message
    assert "RESOURCE_EXHAUSTED" not in message and "\n" not in message


def test_a_checkpoint_save_that_finds_the_disk_full_says_so(tmp_path, monkeypatch):
    from orbax.checkpoint._src.handlers import json_checkpoint_handler

    async def tensorstore_full(self, x, directory):
        raise ValueError(TENSORSTORE_FULL)

    monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", tensorstore_full)
    ckpt = Checkpoints(tmp_path, keep=1)
    with pytest.raises(CheckpointError, match="could not save the checkpoint of step 1: ") as e:
        ckpt.save(1, STATE, {"model": "x"})
        ckpt.wait()
    _check_one_line(str(e.value), ckpt.directory)
    assert "free some space" in str(e.value)
    assert list(ckpt.directory.iterdir()) == []  # no partial checkpoint


def test_an_export_that_finds_the_disk_full_says_so_and_leaves_nothing(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    from jaxdist.train.export import export

    ckpt = Checkpoints(tmp_path / "run", keep=1)
    ckpt.save(1, STATE, {"model": {"d_model": 4}})
    ckpt.close()

    def tensorstore_full(self, directory, *args, **kwargs):
        (directory.parent / f"{directory.name}.orbax-checkpoint-tmp-1").mkdir()  # what orbax leaves
        raise ValueError(TENSORSTORE_FULL)

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", tensorstore_full)
    with pytest.raises(CheckpointError, match=f"could not write {tmp_path / 'out'}: ") as e:
        export(tmp_path / "run", tmp_path / "out")
    _check_one_line(str(e.value), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_preparing_data_on_a_full_disk_says_so_and_leaves_nothing(tmp_path, monkeypatch):
    from jaxdist.train.data import prepare

    def disk_full(self, ids):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(prepare.ShardWriter, "write", disk_full)
    (tmp_path / "in.txt").write_text("some text\n" * 100)
    with pytest.raises(ValueError, match=f"could not write {tmp_path / 'data'}: ") as e:
        prepare.prepare([tmp_path / "in.txt"], tmp_path / "data", progress=False)
    _check_one_line(str(e.value), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


@pytest.fixture
def small_disk(tmp_path):
    """A 128 KiB tmpfs (needs root and permission to mount; skipped otherwise)."""
    where = tmp_path / f"small-{uuid.uuid4().hex[:6]}"
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(where)]).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_checkpoint_save_on_a_really_full_disk_says_so(small_disk):
    ckpt = Checkpoints(small_disk / "run", keep=1)
    with pytest.raises(CheckpointError) as e:
        ckpt.save(1, STATE, {"model": "x"})
        ckpt.wait()
    _check_one_line(str(e.value), ckpt.directory)
    assert list(ckpt.directory.iterdir()) == []
