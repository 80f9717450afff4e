"""Checkpoint checksums: one CRC-32 per piece of each file (summed on several threads), a changed byte
found in any piece, and checkpoints whose sums were recorded per whole file (the older form, under the
older file name, which the per-piece form does not reuse: an older jaxdist would misread it) still
verified."""

import json
import zlib

import numpy as np
import pytest

from jaxdist.train import checksums
from jaxdist.train.checkpoint import Checkpoints
from jaxdist.train.checksums import CHECKSUMS, CHECKSUMS_V1


@pytest.fixture
def saved(tmp_path, monkeypatch):
    monkeypatch.setattr(checksums, "CHUNK_BYTES", 4096)  # the state's data file spans many pieces
    ckpt = Checkpoints(tmp_path, keep=2)
    ckpt.save(1, {"w": np.arange(20_000, dtype=np.float32)}, {})
    ckpt.wait()
    yield ckpt, ckpt.directory / "1"
    ckpt.close()


def _largest(step_dir):
    return max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _flip_byte(path, offset):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def test_each_piece_has_its_crc_and_a_byte_changed_in_a_late_piece_is_found(saved, monkeypatch):
    ckpt, step_dir = saved
    sums = json.loads((step_dir / CHECKSUMS).read_text())
    data = _largest(step_dir)
    size, crcs = sums["files"][str(data.relative_to(step_dir))]
    raw = data.read_bytes()
    assert size == len(raw) > 5 * 4096 and sums["chunk_bytes"] == 4096
    assert crcs == [zlib.crc32(raw[i : i + 4096]) for i in range(0, len(raw), 4096)]  # independent reference
    checksums.verify(step_dir)  # intact
    monkeypatch.setattr(
        checksums, "CHUNK_BYTES", 8192
    )  # a later jaxdist with other pieces still verifies with the recorded ones
    checksums.verify(step_dir)
    _flip_byte(data, len(raw) - 10)  # in the last piece
    with pytest.raises(checksums.Unreadable, match="has changed since it was saved"):
        checksums.verify(step_dir)


def test_sums_recorded_per_whole_file_still_verify_and_still_catch_a_change(saved):
    ckpt, step_dir = saved
    older = {
        str(p.relative_to(step_dir)): [p.stat().st_size, zlib.crc32(p.read_bytes())]
        for p in sorted(step_dir.rglob("*"))
        if p.is_file() and p.name != CHECKSUMS
    }
    (step_dir / CHECKSUMS).unlink()  # as an older jaxdist saved it: under the older name, one CRC per file
    (step_dir / CHECKSUMS_V1).write_text(json.dumps(older))
    checksums.verify(step_dir)
    data = _largest(step_dir)
    _flip_byte(data, data.stat().st_size // 2)
    with pytest.raises(checksums.Unreadable, match="has changed since it was saved"):
        checksums.verify(step_dir)


def test_the_per_piece_form_under_the_older_name_verifies(saved):
    """One development commit wrote the per-piece form as jaxdist_checksums.json: read by its content."""
    ckpt, step_dir = saved
    (step_dir / CHECKSUMS).replace(step_dir / CHECKSUMS_V1)
    checksums.verify(step_dir)
    data = _largest(step_dir)
    _flip_byte(data, 5)
    with pytest.raises(checksums.Unreadable, match="has changed since it was saved"):
        checksums.verify(step_dir)


def test_a_file_cut_short_while_summed_gives_a_sum_that_fails_not_a_crash(saved):
    """Pieces are read, not memory-mapped: a piece past the end of a file truncated after it was listed
    sums what is there (a mapped read there was SIGBUS, the process killed)."""
    _, step_dir = saved
    data = _largest(step_dir)
    size = data.stat().st_size
    assert checksums.piece_crc(data, size + 4096, 4096) == zlib.crc32(b"")
    assert checksums.piece_crc(data, size - 10, 4096) == zlib.crc32(data.read_bytes()[-10:])
