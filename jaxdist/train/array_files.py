"""A train state's arrays as safetensors files written at the disk's speed, and read back onto any layout.

Each process writes the shards it owns once (those of replica 0: together, the processes' files hold
each array once) into up to 8 safetensors files, `arrays.<process>.<k>.safetensors`, of about equal
size. A blob is named by its leaf's path (`params/blocks/3/fc/kernel`), followed by `@start:stop,...`
when it is a slice of the array (a shard, or rows of a large array spread over files); each file's
`__metadata__` records the global shape and dtype of the leaves it holds pieces of, so a reader needs
nothing else. They are ordinary safetensors files (`safetensors.safe_open` reads them; `read_tree`
joins the slices).

The files are written side by side, one thread each (a file system serializes the writes into one
file: 8 threads writing one file ran at the speed of one), with `os.pwritev` straight from the
arrays' host memory, each `CHUNK_BYTES` piece's CRC-32 summed from memory as it is written, so the
checksums need no second read. A writer takes an array's value only when its writes reach it, so the
copies into host memory of the arrays later in a file overlap the writes of those before. Each file
is fsync'd before `write_arrays` returns; orbax's item handler over it (`jaxdist.train.arrays_handler`)
renames the checkpoint into place only after every process's write has. Orbax's own per-array writer
costs about a millisecond per array on top of the bytes (a GPT's train state has hundreds), which is
what these files exist to avoid.

A restore reads each target shard straight from the files (memory-mapped), only the bytes of the
slices that device needs, onto any sharding: whatever layout saved the state.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from jaxdist.train.checksums import crc32
from jaxdist.train.host_copy import HostSlice

FORMAT = "jaxdist.arrays/1"
CHUNK_BYTES = 16 << 20  # a piece of a file: what one thread writes and sums at a time
_NAMES = {  # numpy dtype -> safetensors dtype name
    np.dtype(np.float64): "F64",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
    np.dtype(np.int16): "I16",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint64): "U64",
    np.dtype(np.uint32): "U32",
    np.dtype(np.uint16): "U16",
    np.dtype(np.uint8): "U8",
    np.dtype(np.bool_): "BOOL",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(ml_dtypes.float8_e5m2): "F8_E5M2",
}
_DTYPES = {name: dtype for dtype, name in _NAMES.items()}
_SLICE = re.compile(r"(\d+):(\d+)")  # one dimension of a blob's box in its name: start:stop


def leaf_name(path) -> str:
    """A leaf's name in the files: its tree path joined by "/" (`opt_state/0/mu/blocks/3/fc/kernel`)."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def _workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover (not Linux)
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


# -- writing ----------------------------------------------------------------------------------------


class _HostValue:
    """One array's value in host memory as a C-contiguous NumPy array, converted once, by the first writer
    thread that needs it (the copies into host memory finish while the files are already being written)."""

    def __init__(self, source):
        self.source, self._lock, self._value = source, threading.Lock(), None

    def get(self) -> np.ndarray:
        with self._lock:
            if self._value is None:
                if isinstance(self.source, jax.Array):  # a copy in flight: waited for without the interpreter lock
                    self.source.block_until_ready()
                self._value = np.ascontiguousarray(np.asarray(self.source))
                self.source = None
            return self._value


@dataclasses.dataclass(frozen=True)
class _Blob:
    key: str
    source: _HostValue
    shape: tuple[int, ...]
    dtype: np.dtype
    order: int  # its leaf's position in the tree: the order a packed copy's runs arrive in
    rows: tuple[int, int] | None = None  # a slice of the source along its first dimension

    @functools.cached_property
    def nbytes(self) -> int:
        # once per blob, in plain ints: a save asks each of its ~450 blobs several times, on the threads
        # that run beside the training loop (NumPy's prod took ~6 us a call, with the interpreter held)
        return math.prod(self.shape) * self.dtype.itemsize

    def value(self) -> np.ndarray:
        whole = self.source.get()
        return whole if self.rows is None else whole[self.rows[0] : self.rows[1]]


def _local_blobs(tree) -> tuple[list[_Blob], dict]:
    """This process's share of `tree`'s arrays (the shards of replica 0 it holds) and every leaf's
    global shape and dtype. NumPy values, and arrays of a packed host copy (`host_copy.HostSlice`, read
    once their transfer is done), are leaves of their own (written whole by process 0)."""
    blobs, leaves = [], {}
    for order, (path, x) in enumerate(jax.tree_util.tree_flatten_with_path(tree)[0]):
        name = leaf_name(path)
        if "@" in name or name in leaves:
            raise ValueError(f"checkpoint: leaf name {name!r} is ambiguous (an '@' in a key, or two keys alike)")
        x = x if isinstance(x, jax.Array | np.ndarray | HostSlice) else np.asarray(x)
        dtype = np.dtype(x.dtype)
        if dtype not in _NAMES:
            raise ValueError(f"checkpoint: {name} is {dtype}, which the checkpoint format does not hold")
        leaves[name] = {"shape": list(x.shape), "dtype": _NAMES[dtype]}
        if isinstance(x, np.ndarray | HostSlice):
            if jax.process_index() == 0:
                blobs.append(_Blob(name, _HostValue(x), x.shape, dtype, order))
            continue
        for shard in x.addressable_shards:
            if shard.replica_id != 0:
                continue
            box = [s.indices(n)[:2] for s, n in zip(shard.index, x.shape, strict=True)]
            whole = all(box_dim == (0, n) for box_dim, n in zip(box, x.shape, strict=True))
            key = name if whole else name + "@" + ",".join(f"{a}:{b}" for a, b in box)
            blobs.append(_Blob(key, _HostValue(shard.data), tuple(shard.data.shape), dtype, order))
    return blobs, leaves


def _header(blobs: list[_Blob], leaves: dict) -> bytes:
    """The safetensors header of `blobs` laid out in order, padded so the data starts 8-byte aligned; its
    metadata describes the leaves the blobs belong to."""
    entries, offset = {}, 0
    for blob in blobs:
        n = blob.nbytes
        entries[blob.key] = {
            "dtype": _NAMES[blob.dtype],
            "shape": list(blob.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    own = {name: leaves[name] for name in sorted({blob.key.partition("@")[0] for blob in blobs})}
    meta = {"format": FORMAT, "leaves": json.dumps(own, separators=(",", ":"))}
    text = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return len(text).to_bytes(8, "little") + text


def _split_rows(blob: _Blob, most_bytes: int) -> list[_Blob]:
    """`blob` as blobs of whole rows (along its first dimension) of at most about `most_bytes` each, so
    that one large array does not make one file, written by one thread, the last to finish."""
    shape = blob.shape
    if len(shape) == 0 or shape[0] < 2 or blob.nbytes <= most_bytes:
        return [blob]
    name, _, where = blob.key.partition("@")
    box = [tuple(map(int, a)) for a in _SLICE.findall(where)] or [(0, n) for n in shape]
    rows = max(1, most_bytes // (blob.nbytes // shape[0]))
    out, first = [], blob.rows[0] if blob.rows else 0  # rows of the source (a blob split before starts later)
    for r in range(0, shape[0], rows):
        stop = min(r + rows, shape[0])
        cut = [(box[0][0] + r, box[0][0] + stop), *box[1:]]
        key = name + "@" + ",".join(f"{a}:{b}" for a, b in cut)
        part = (stop - r, *shape[1:])
        out.append(_Blob(key, blob.source, part, blob.dtype, blob.order, rows=(first + r, first + stop)))
    return out


def _into_files(blobs: list[_Blob], files: int) -> list[list[_Blob]]:
    """`blobs` spread over `files` groups of about equal bytes (the largest first, each to the lightest group),
    each group in the order it is laid out: the widest items first, so every blob starts at a multiple of
    its item size, then in the tree's order: the order a packed host copy's runs arrive in, so each
    file's writes start with the first runs and rarely wait after."""
    groups: list[list[_Blob]] = [[] for _ in range(files)]
    loads = [0] * files
    for blob in sorted(blobs, key=lambda b: -b.nbytes):
        k = loads.index(min(loads))
        groups[k].append(blob)
        loads[k] += blob.nbytes
    # a process that holds no shard of replica 0 (e.g. the second dp row of HSDP) still writes one file: every
    # process's save then runs the same steps, and the file records the leaves it saw
    return [sorted(g, key=_laid_out) for g in groups if g] or [[]]


def _laid_out(blob: _Blob) -> tuple[int, int, int]:
    return -blob.dtype.itemsize, blob.order, blob.rows[0] if blob.rows else 0


@dataclasses.dataclass
class _FileWrite:
    size: int
    crcs: list[int]
    waited_s: float  # for the blobs' values in host memory


def _write_file(path: Path, blobs: list[_Blob], leaves: dict, chunk: int, summing: ThreadPoolExecutor) -> _FileWrite:
    """Write one safetensors file of `blobs` and fsync it; returns its size, the CRC-32 of each `chunk`
    bytes, summed from memory on `summing`'s threads while this one writes them (the writes and sums
    release the GIL: the files of one save are written side by side, and on an H200 host the sums took
    a tenth of a writer's time), and the time spent waiting for the blobs' host values (each taken
    only when the writes reach it)."""
    header = _header(blobs, leaves)
    waited = 0.0

    def segments():
        nonlocal waited
        yield memoryview(header)
        for blob in blobs:
            if blob.nbytes:
                began = time.perf_counter()
                data = blob.value()
                waited += time.perf_counter() - began
                yield memoryview(data.reshape(-1).view(np.uint8))

    size, crcs = len(header) + sum(b.nbytes for b in blobs), []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for offset, views in _pieces(segments(), chunk):
            crcs.append(_sum_beside(summing, views))
            _pwrite_all(fd, views, offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    return _FileWrite(size, [crc.result() for crc in crcs], waited)


def _sum_beside(summing: ThreadPoolExecutor, views: list[memoryview]) -> Future:
    try:
        return summing.submit(_crc_of, views)
    except RuntimeError:  # the interpreter is exiting: its thread pools take no new work
        done = Future()
        done.set_result(_crc_of(views))
        return done


def _crc_of(views: list[memoryview]) -> int:
    crc = 0
    for view in views:
        crc = crc32(view, crc)
    return crc


def _pieces(segments: Iterable[memoryview], chunk: int) -> Iterator[tuple[int, list[memoryview]]]:
    """The file's bytes (`segments` back to back) cut at every multiple of `chunk`: (offset, views), each
    piece as soon as its segments are (a segment is taken only when the piece before it is written)."""
    current, start, offset, any_piece = [], 0, 0, False
    for view in segments:
        position = 0
        while position < len(view):
            take = min(len(view) - position, chunk - (offset - start))
            current.append(view[position : position + take])
            position += take
            offset += take
            if offset - start == chunk:
                yield start, current
                any_piece, current, start = True, [], offset
    if current or not any_piece:
        yield start, current


def _pwrite_all(fd: int, views: list[memoryview], offset: int) -> None:
    """Write `views` at `offset`: pwritev may write less than asked (and at most IOV_MAX views); the rest follows."""
    while views:
        written = os.pwritev(fd, views[:1024], offset)
        offset += written
        while views and written >= len(views[0]):
            written -= len(views[0])
            views = views[1:]
        if views and written:
            views = [views[0][written:], *views[1:]]


@dataclasses.dataclass(frozen=True)
class Written:
    """What `write_arrays` wrote: its files' checksums as `Checkpoints` records them (`{name: [size,
    [CRC-32 of each chunk_bytes piece]]}`); `copy_s`, the longest one writer thread waited for host values
    (the copies into host memory still in flight when the writes reached them), and `write_s`, the rest
    of the writing's wall time."""

    sums: dict
    chunk_bytes: int
    copy_s: float
    write_s: float


FILE_BYTES = 32 << 20  # a save's bytes spread over files of at least this much (at most one per thread)


def write_arrays(directory: Path, tree, chunk_bytes: int = CHUNK_BYTES) -> Written:
    """Write this process's share of `tree` (host or device arrays: copies of the state, which the training
    loop does not overwrite) into `directory`, in up to 8 files written side by side (one file is written
    by one thread at a time: a file system serializes the writes into one file), each fsync'd and summed
    by `chunk_bytes` pieces as it is written (on threads of their own). An array's value is taken when
    its file's writes reach it: the copies into host memory of the arrays written later overlap the
    writes of those written first."""
    began = time.perf_counter()
    Path(directory).mkdir(parents=True, exist_ok=True)
    blobs, leaves = _local_blobs(tree)
    total = sum(b.nbytes for b in blobs)
    files = max(1, min(_workers(), total // FILE_BYTES))
    blobs = [part for blob in blobs for part in _split_rows(blob, max(FILE_BYTES, total // (2 * files)))]
    groups = _into_files(blobs, files)
    paths = [Path(directory) / f"arrays.{jax.process_index()}.{k}.safetensors" for k in range(len(groups))]
    with (
        ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="jaxdist-write") as pool,
        ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="jaxdist-sum") as summing,
    ):
        writing = [
            pool.submit(_write_file, p, g, leaves, chunk_bytes, summing) for p, g in zip(paths, groups, strict=True)
        ]
        written = [f.result() for f in writing]
    sums = {path.name: [w.size, w.crcs] for path, w in zip(paths, written, strict=True)}
    waited = max(w.waited_s for w in written)
    return Written(sums, chunk_bytes, copy_s=waited, write_s=time.perf_counter() - began - waited)


# -- reading ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Stored:
    file: Path
    offset: int  # of the blob's first byte in the file
    box: tuple[tuple[int, int], ...]  # [start, stop) along each dimension of the leaf
    dtype: np.dtype


class ArrayFiles:
    """The arrays saved in a directory by `write_arrays` (every process's file), read by leaf name."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        files = sorted(self.directory.glob("arrays.*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.directory} holds no arrays.*.safetensors")
        self.leaves: dict[str, dict] = {}
        self.blobs: dict[str, list[_Stored]] = {}
        self._maps: dict[Path, np.memmap] = {}
        self._lock = threading.Lock()
        for file in files:
            header, start = _read_header(file)
            meta = header.pop("__metadata__", {})
            if meta.get("format") != FORMAT:
                raise ValueError(f"{file.name} is not a jaxdist arrays file (format {meta.get('format')!r})")
            self.leaves.update(json.loads(meta["leaves"]))
            for key, entry in header.items():
                name, _, where = key.partition("@")
                shape = self.leaves[name]["shape"]
                box = (
                    tuple((int(a), int(b)) for a, b in _SLICE.findall(where)) if where else tuple((0, n) for n in shape)
                )
                begin, end = entry["data_offsets"]
                dtype = _DTYPES[entry["dtype"]]
                if len(box) != len(shape) or end - begin != int(np.prod([b - a for a, b in box])) * dtype.itemsize:
                    raise ValueError(f"{file.name}: entry {key} does not match its leaf's shape {shape}")
                self.blobs.setdefault(name, []).append(_Stored(file, start + begin, box, dtype))

    def _map(self, file: Path) -> np.memmap:
        with self._lock:
            if file not in self._maps:
                self._maps[file] = np.memmap(file, np.uint8, mode="r")
            return self._maps[file]

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
        leaf = self.leaves[name]
        return tuple(leaf["shape"]), _DTYPES[leaf["dtype"]]

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """The values of leaf `name` in the region `index` (slices with steps of 1; default: all), copied
        from the blobs that hold them. A region some blob does not cover raises."""
        shape, dtype = self.shape_dtype(name)
        index = tuple(slice(None) for _ in shape) if index is None else index
        want = tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
        out = np.empty(tuple(b - a for a, b in want), dtype)
        covered = 0
        for stored in self.blobs.get(name, ()):
            cut = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(want, stored.box, strict=True))
            if any(a >= b for a, b in cut):
                continue
            blob_shape = tuple(b - a for a, b in stored.box)
            count = int(np.prod(blob_shape))
            raw = self._map(stored.file)[stored.offset : stored.offset + count * dtype.itemsize]
            values = raw.view(dtype).reshape(blob_shape)
            source = tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(cut, stored.box, strict=True))
            target = tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(cut, want, strict=True))
            out[target] = values[source]
            covered += int(np.prod([b - a for a, b in cut]))
        if covered != out.size:  # blobs never overlap (one replica of each shard), so the count is exact
            raise ValueError(f"checkpoint: {name} is incomplete: {covered} of {out.size} values of {want} saved")
        return out


def _read_header(file: Path) -> tuple[dict, int]:
    with file.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n <= 0 or n > 1 << 30:
            raise ValueError(f"{file.name} has no safetensors header")
        return json.loads(f.read(n)), 8 + n


def restore_arrays(directory: Path, target) -> Any:
    """`target`'s tree (ShapeDtypeStructs with shardings) with each leaf read onto its sharding from the
    files in `directory`, every device reading only its own slice. A leaf missing or of another shape
    or dtype raises, naming it."""
    files = ArrayFiles(directory)

    def read(path, want):
        name = leaf_name(path)
        if name not in files.leaves:
            raise ValueError(f"checkpoint: {name} is not in the checkpoint")
        shape, dtype = files.shape_dtype(name)
        if shape != tuple(want.shape) or dtype != np.dtype(want.dtype):
            raise ValueError(
                f"checkpoint: {name} was saved as {dtype}{list(shape)}, the run has {want.dtype}{list(want.shape)}"
            )
        sharding = getattr(want, "sharding", None)
        if sharding is None:
            return files.read(name)
        return jax.make_array_from_callback(shape, sharding, lambda index: files.read(name, index))

    return jax.tree_util.tree_map_with_path(read, target)


def read_tree(directory: Path, prefix: str = "", place: Callable[[tuple[int, ...]], Any] | None = None) -> dict:
    """Every leaf under `prefix` ("params") in nested dicts keyed by the path's parts (list indices as
    strings, "0", "1", ..., as orbax hands them back): host arrays, or with `place` each read straight
    onto the sharding `place(shape)` returns (every device reading its own slices)."""
    files = ArrayFiles(directory)
    out: dict = {}
    head = prefix + "/" if prefix else ""
    for name in files.leaves:
        if not name.startswith(head):
            continue
        node, parts = out, name[len(head) :].split("/")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        if place is None:
            node[parts[-1]] = files.read(name)
        else:
            shape = files.shape_dtype(name)[0]
            node[parts[-1]] = jax.make_array_from_callback(shape, place(shape), functools.partial(files.read, name))
    return out
