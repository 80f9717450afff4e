"""Which read failures set a checkpoint aside (`Checkpoints.newest_readable`): one that says the
checkpoint is bad does, and the previous one is used; running out of memory says nothing about a
checkpoint whose files verified, so it stops the resume on one line and leaves the checkpoint in place."""

import numpy as np
import pytest

from jaxdist.train.checkpoint import CheckpointError, Checkpoints


@pytest.fixture
def two_saves(tmp_path):
    ckpt = Checkpoints(tmp_path, keep=3)
    for step in (1, 2):
        ckpt.save(step, {"w": np.full((4,), float(step), np.float32)}, {})
    ckpt.wait()
    yield ckpt
    ckpt.close()


def _failing_at(step: int, error: Exception):
    def read(s: int):
        if s == step:
            raise error
        return s

    return read


@pytest.mark.parametrize(
    "error", [MemoryError(), RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8 bytes")]
)
def test_running_out_of_memory_while_reading_keeps_the_checkpoint_and_stops(two_saves, error):
    with pytest.raises(CheckpointError, match="ran out of memory .* it is left in place") as e:
        two_saves.newest_readable(_failing_at(2, error))
    assert "\n" not in str(e.value)
    assert sorted(two_saves.manager.all_steps()) == [1, 2]
    assert not two_saves.unreadable_dir.exists()


def test_a_read_that_finds_the_checkpoint_bad_sets_it_aside_and_uses_the_previous_one(two_saves, capfd):
    found = two_saves.newest_readable(_failing_at(2, ValueError("cannot decode array 'w'")))
    assert "is unreadable (cannot decode array 'w')" in capfd.readouterr().err
    assert found == (1, 1)
    assert (two_saves.unreadable_dir / "2").exists()


def test_a_resume_reads_a_checkpoints_files_for_their_checksums_once(two_saves, monkeypatch):
    """The trainer looks for the newest readable checkpoint twice (its metadata, then its state): the
    files are summed once."""
    import jaxdist.train.checkpoint as checkpoint

    summed = []
    original = checkpoint._file_sums
    monkeypatch.setattr(checkpoint, "_file_sums", lambda d, *a: summed.append(d.name) or original(d, *a))
    for _ in range(2):
        assert two_saves.newest_readable(lambda s: s) == (2, 2)
    assert summed == ["2"]
