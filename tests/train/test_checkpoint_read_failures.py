"""Which read failures set a checkpoint aside (`Checkpoints.newest_readable`): one that says the
checkpoint is bad does, and the previous one is tried; running out of memory says nothing about a
checkpoint whose files verified, so it stops the resume on one line and leaves the checkpoint in place."""

import shutil

import jax
import numpy as np
import pytest

from jaxdist.train.checkpoint import CheckpointError, Checkpoints
from jaxdist.train.checksums import CHECKSUMS


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
    import jaxdist.train.checksums as checksums

    summed = []
    original = checksums.file_sums
    monkeypatch.setattr(checksums, "file_sums", lambda d, *a: summed.append(d.name) or original(d, *a))
    for _ in range(2):
        assert two_saves.newest_readable(lambda s: s) == (2, 2)
    assert summed == ["2"]


DAMAGED_CHECKSUMS = {
    "empty": b"",
    "cut short": b'{"chunk_bytes": 16777216, "fi',
    "not UTF-8": b"\xff\xfe\x00",
    "an empty object": b"{}",
    "a list": b"[]",
    "no files": b'{"chunk_bytes": 16777216, "files": {}}',
    "a zero piece size": b'{"chunk_bytes": 0, "files": {"a": [1, [0]]}}',
    "an entry of the wrong shape": b'{"chunk_bytes": 16777216, "files": {"a": "x"}}',
}


@pytest.mark.parametrize("content", DAMAGED_CHECKSUMS.values(), ids=DAMAGED_CHECKSUMS.keys())
def test_a_damaged_checksum_file_is_neither_trusted_nor_lost_and_the_warning_names_it(two_saves, content, capfd):
    step_dir = two_saves.directory / "2"
    files = {p.relative_to(step_dir): p.read_bytes() for p in step_dir.rglob("*") if p.is_file()}
    (step_dir / CHECKSUMS).write_bytes(content)
    assert two_saves.newest_readable(lambda s: s) == (1, 1)  # not trusted: the previous checkpoint is used
    err = capfd.readouterr().err
    aside = two_saves.unreadable_dir / "2"
    assert err.count("\n") == 1 and f"checkpoints/2 cannot be verified (its checksum file {CHECKSUMS} is damaged" in err
    tried = f"moved to {aside}; the previous one is tried instead"
    assert f"{tried}; if you trust its files, delete {aside / CHECKSUMS}" in err
    for name, raw in files.items():  # nothing lost: every data file kept as it was
        if name.name != CHECKSUMS:
            assert (aside / name).read_bytes() == raw


def test_following_the_advice_for_an_unverifiable_checkpoint_resumes_it(two_saves):
    (two_saves.directory / "2" / CHECKSUMS).write_text("{")
    two_saves.newest_readable(lambda s: s)
    aside = two_saves.unreadable_dir / "2"
    (aside / CHECKSUMS).unlink()
    shutil.move(aside, two_saves.directory / "2")
    two_saves.manager.reload()
    restored = two_saves.restore(2, {"w": jax.ShapeDtypeStruct((4,), np.float32)})
    np.testing.assert_array_equal(restored["w"], np.full((4,), 2.0, np.float32))


def test_a_checkpoint_set_aside_twice_at_one_step_keeps_both(two_saves):
    """A run that fell back from step 2 trains to step 2 again; if that one is set aside too, the first stays."""
    two_saves.newest_readable(_failing_at(2, ValueError("bad")))
    two_saves.save(2, {"w": np.full((4,), 20.0, np.float32)}, {})
    two_saves.wait()
    two_saves.newest_readable(_failing_at(2, ValueError("bad again")))
    assert sorted(p.name for p in two_saves.unreadable_dir.iterdir()) == ["2", "2.2"]


def test_a_checkpoint_without_its_checksum_file_is_read_and_said_to_be_unverified(two_saves, capfd):
    """A save whose process ended between orbax's commit and the checksum file was trusted in silence."""
    (two_saves.directory / "2" / CHECKSUMS).unlink()
    assert two_saves.newest_readable(lambda s: s) == (2, 2)
    assert "checkpoints/2 has no checksum file (its save ended before writing it); read unverified" in (
        capfd.readouterr().err
    )
