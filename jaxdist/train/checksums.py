"""The checksums of a checkpoint's files: written after each save, checked before a checkpoint is read.

`CHECKSUMS` holds the size of every file and a CRC-32 of each 16 MiB piece of it (`CHUNK_BYTES`), so the
pieces of one large file are summed on several threads (ISA-L's CRC-32: the same sums as zlib's, ~5x
faster per core). Checkpoints saved before the per-piece form hold `CHECKSUMS_V1`, one CRC per file;
both verify. A file that fails them, is missing, or has another size raises `Unreadable`; a checksum
file that cannot be read raises `Unverifiable`.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

try:  # ISA-L's CRC-32: the same sums as zlib's, ~5x faster (18 vs 3.2 GiB/s on one x86 core)
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover (isal is a dependency; a platform without its wheels uses zlib's)
    from zlib import crc32

from jaxdist.train.report import first_line

CHECKSUMS = "jaxdist_checksums.v2.json"  # per-piece CRCs; a new name, so an older jaxdist does not misread it
CHECKSUMS_V1 = "jaxdist_checksums.json"  # per-file CRCs, written by jaxdist before the per-piece form
CHUNK_BYTES = 16 << 20  # one CRC-32 per piece, so the pieces of one large file are summed in parallel
INLINE_BYTES = 1 << 20  # at most this much left to sum: summed on the caller's thread (which keeps its buffer)


class Unreadable(Exception):
    """A checkpoint whose files do not match the checksums recorded when it was saved."""


class Unverifiable(Unreadable):
    """A checkpoint whose checksum file cannot be read: its data files may be good, but nothing vouches for them."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"its checksum file {path.name} is damaged: {why}")
        self.name = path.name


def sum_workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))  # the CPUs this process may use (containers, taskset)
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


_buffers = threading.local()


def piece_crc(path: Path, offset: int, chunk_bytes: int) -> int:
    """CRC-32 of `chunk_bytes` of `path` from `offset` (fewer at the end), read into this thread's buffer:
    plain reads, so a bad block is an OSError and a file cut short meanwhile a sum of what is there
    (both fail verification), never SIGBUS."""
    want = max(0, min(chunk_bytes, path.stat().st_size - offset))
    buffer = getattr(_buffers, "piece", None)
    if buffer is None or len(buffer) < want:
        buffer = _buffers.piece = bytearray(want)
    view, n = memoryview(buffer), 0
    with path.open("rb", buffering=0) as f:
        f.seek(offset)
        while n < want and (got := f.readinto(view[n:want])):  # a read may return less than asked
            n += got
    return crc32(view[:n])  # the read and crc32 release the GIL: pieces are summed in parallel


def file_sums(step_dir: Path, chunk_bytes: int | None = None, known: dict | None = None) -> dict:
    """`{"chunk_bytes": C, "files": {name: [size, [CRC-32 of each C-byte piece]]}}` of the files in `step_dir`,
    the pieces summed on several threads (a few small ones on this thread); `known`: the sums of some
    files already (summed as they were written, in pieces of `chunk_bytes`), taken as they are where the
    file still has that size."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    sizes = {
        p: p.stat().st_size
        for p in sorted(step_dir.rglob("*"))
        if p.is_file() and not p.name.startswith((CHECKSUMS, CHECKSUMS_V1))
    }
    files = {str(p.relative_to(step_dir)): [size, []] for p, size in sizes.items()}
    for name, (size, crcs) in (known or {}).items():
        if name in files and files[name][0] == size:
            files[name][1] = list(crcs)
    pieces = [
        (p, offset)
        for p, size in sizes.items()
        if not files[str(p.relative_to(step_dir))][1]
        for offset in range(0, max(size, 1), chunk_bytes)
    ]
    if sum(min(chunk_bytes, sizes[p] - offset) for p, offset in pieces) <= INLINE_BYTES:
        # a few small files (a save's metadata beside array files summed as written): threads would cost more
        crcs = [piece_crc(*piece, chunk_bytes) for piece in pieces]
    else:
        with ThreadPoolExecutor(max_workers=sum_workers(), thread_name_prefix="jaxdist-crc") as pool:
            crcs = list(pool.map(lambda piece: piece_crc(*piece, chunk_bytes), pieces))
    for (p, _), crc in zip(pieces, crcs, strict=True):
        files[str(p.relative_to(step_dir))][1].append(crc)
    return {"chunk_bytes": chunk_bytes, "files": files}


def write_checksums(step_dir: Path, known: dict) -> None:
    """Record the sums of every file in `step_dir` (`known`: those summed while they were written)."""
    tmp = step_dir / f"{CHECKSUMS}.tmp"
    tmp.write_text(json.dumps(file_sums(step_dir, known=known)))
    tmp.replace(step_dir / CHECKSUMS)  # atomic: a checkpoint has its whole list of sums or none


def recorded_sums(step_dir: Path) -> Path | None:
    """The file of `step_dir`'s checksums, if it has one."""
    return next((step_dir / n for n in (CHECKSUMS, CHECKSUMS_V1) if (step_dir / n).is_file()), None)


def verify(step_dir: Path) -> None:
    """Raise Unreadable if the files in `step_dir` differ from those recorded at save (if recorded)."""
    recorded = recorded_sums(step_dir)
    if recorded is None:
        return  # saved before checksums existed, or the process died right after orbax finished
    expected = read_checksums(recorded)
    if "chunk_bytes" in expected:  # per piece (under the older name too, as one development commit wrote)
        found = file_sums(step_dir, expected["chunk_bytes"])
    else:  # {name: [size, CRC-32 of the whole file]}, as jaxdist wrote before
        expected, found = {"files": expected}, {"files": {}}
        for name in expected["files"]:
            path = step_dir / name
            if path.is_file():
                found["files"][name] = [path.stat().st_size, whole_file_crc(path)]
    for name, (size, crc) in expected["files"].items():
        if name not in found["files"]:
            raise Unreadable(f"{name} is missing")
        if found["files"][name][0] != size:
            raise Unreadable(f"{name} has {found['files'][name][0]} bytes, saved with {size}")
        if found["files"][name][1] != crc:
            raise Unreadable(f"{name} has changed since it was saved")


def read_checksums(path: Path) -> dict:
    """The sums recorded in `path`, either form, checked for shape: a damaged file that still parses (`{}`,
    a list, a size that is not a number) must not verify a checkpoint by checking nothing."""
    try:
        sums = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        raise Unverifiable(path, first_line(e)) from None
    per_piece = isinstance(sums, dict) and "chunk_bytes" in sums
    files = sums.get("files") if per_piece else sums
    if per_piece and not (isinstance(sums["chunk_bytes"], int) and sums["chunk_bytes"] > 0):
        raise Unverifiable(path, f"chunk_bytes is {sums['chunk_bytes']!r}")
    if not isinstance(files, dict) or not files:
        raise Unverifiable(path, "it lists no files")
    for name, entry in files.items():
        sums_ok = isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int)
        crcs_ok = sums_ok and (
            isinstance(entry[1], list) and all(isinstance(c, int) for c in entry[1])
            if per_piece
            else isinstance(entry[1], int)
        )
        if not crcs_ok:
            raise Unverifiable(path, f"its entry for {name} is not [size, CRC]")
    return sums


def whole_file_crc(path: Path) -> int:
    """The CRC-32 of a whole file, as checkpoints saved before the per-piece sums recorded it."""
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            crc = crc32(chunk, crc)
    return crc
