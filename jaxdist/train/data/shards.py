"""Reading prepared shards with grain: batches that are a pure function of (seed, step, row).

A split's shards are memory-mapped and seen as one token array. Row r of the
split is the `seq_len + 1` tokens starting at r * stride. The global batch of
step s holds samples s*B .. s*B + B - 1 of an endless stream in which epoch e is
a permutation of all rows seeded by (seed, e) (grain's `shuffle` then `repeat`).
So a batch depends only on (seed, step) and the data, never on what was read
before: the loader's whole state is the step number (and, after a resume with
another batch size, the sample the stream continues from: an offset), a resumed
run continues exactly where it stopped, and it does so for any process count,
because each process reads only the rows of the global batch its devices hold.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import grain
import jax
import numpy as np

from jaxdist.train.data import prepare as prepare_lib
from jaxdist.train.data import tokenize


def read_index(directory: str | Path) -> dict:
    path = Path(directory) / prepare_lib.INDEX
    if not path.is_file():
        raise ValueError(f"{directory} has no {prepare_lib.INDEX}; make it with: jaxdist prepare-data FILES --out DIR")
    try:
        index = json.loads(path.read_text())
    except ValueError as e:  # not JSON, or not UTF-8
        raise ValueError(f"{path} is damaged ({e}); prepare the data again") from None
    if not isinstance(index, dict) or index.get("format") != prepare_lib.FORMAT:
        raise ValueError(f"{path} is not a {prepare_lib.FORMAT} index; prepare the data again")
    return index


# what index.json records about where things were (the inputs' paths, a tokenizer file's path), not what the data is
# what the content id leaves out: where the tokenizer came from, and the SHA-256 of that file (the copy in the
# directory, hashed below, is what the data holds; an id without it stays the id of data prepared before it)
_WHERE_KEYS = ("tokenizer_source", "tokenizer_sha256")


def content_id(directory: str | Path) -> str:
    """SHA-256 of what a data directory holds, wherever it lies: its index without the paths it records
    (preparing is deterministic from the inputs' contents, which the index records by SHA-256, and the
    options) and its tokenizer file. Moving or copying the directory keeps it; other data changes it."""
    index = {k: v for k, v in read_index(directory).items() if k not in _WHERE_KEYS}
    index["inputs"] = [{k: v for k, v in f.items() if k != "path"} for f in index.get("inputs", [])]
    digest = hashlib.sha256(json.dumps(index, sort_keys=True).encode())
    tokenizer_file = Path(directory) / tokenize.TOKENIZER_FILE
    if tokenizer_file.is_file():
        digest.update(tokenizer_file.read_bytes())
    return digest.hexdigest()


def load_tokenizer(directory: str | Path):
    """The tokenizer a prepared data directory was made with."""
    return tokenize.load(directory, read_index(directory)["tokenizer"])


def _open_shard(path: Path, dtype: np.dtype, tokens: int) -> np.memmap:
    """The shard `path` memory-mapped, checked to hold the `tokens` its index records."""
    size = path.stat().st_size if path.is_file() else None
    if size != tokens * dtype.itemsize:
        have = "is missing" if size is None else f"has {size} bytes"
        raise ValueError(
            f"shard {path} {have}, the index says {tokens} {dtype.name} tokens ({tokens * dtype.itemsize} bytes); "
            "the data directory is damaged: prepare it again with jaxdist prepare-data"
        )
    return np.memmap(path, dtype=dtype, mode="r")


class TokenShards:
    """One split of a data directory as one random-access token array over memory-mapped shards."""

    def __init__(self, directory: str | Path, split: str):
        self.directory = Path(directory)
        index = read_index(directory)
        dtype = np.dtype(index["dtype"]).newbyteorder("<")
        if split not in index.get("splits", {}):
            raise ValueError(f"{directory} has no {split} split; prepare the data with jaxdist prepare-data")
        shards = [s for s in index["splits"][split]["shards"] if s["tokens"]]
        self.maps = [_open_shard(self.directory / s["file"], dtype, s["tokens"]) for s in shards]
        self.starts = np.cumsum([0] + [len(m) for m in self.maps])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as int32, across shard boundaries."""
        pieces, pos, end = [], start, start + length
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while pos < end:
            offset = pos - self.starts[shard]
            take = min(end - pos, len(self.maps[shard]) - offset)
            pieces.append(self.maps[shard][offset : offset + take])
            pos, shard = pos + take, shard + 1
        return np.concatenate(pieces).astype(np.int32)


class Windows:
    """grain random-access source: row r is tokens [r * stride, r * stride + seq_len + 1)."""

    def __init__(self, tokens: TokenShards, seq_len: int, stride: int):
        self.tokens, self.width, self.stride = tokens, seq_len + 1, stride
        self.rows = (len(tokens) - self.width) // stride + 1 if len(tokens) >= self.width else 0

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, row: int) -> np.ndarray:
        return self.tokens.read(int(row) * self.stride, self.width)


def device_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...], devices) -> list[int]:
    """The rows of a global batch of `global_shape` that `devices` hold under `sharding` (sorted)."""
    indices = sharding.devices_indices_map(global_shape)
    rows: set[int] = set()
    for device in devices:
        rows.update(range(global_shape[0])[indices[device][0]])
    return sorted(rows)


class ShardData:
    """Training or validation batches from a prepared data directory, read through grain."""

    def __init__(self, directory: str | Path, split: str, seq_len: int, seed: int, stride: int, shuffle: bool):
        self.directory, self.split, self.seed, self.shuffle = Path(directory), split, seed, shuffle
        index = read_index(directory)
        self.vocab_size = index["vocab_size"]
        self.windows = Windows(TokenShards(directory, split), seq_len, stride)
        self.width = seq_len + 1
        if len(self.windows) == 0:
            have = len(self.windows.tokens)
            fix = (
                "raise data.val_fraction (or --val-fraction of jaxdist prepare-data)"
                if split == "val"
                else "give more text"
            )
            raise ValueError(f"the {split} split of {directory} has {have} tokens, fewer than seq_len + 1; {fix}")

    def samples(self) -> grain.MapDataset:
        """The endless sample stream: each epoch a fresh permutation of the rows (or the rows in order)."""
        rows = grain.MapDataset.source(self.windows)
        if self.shuffle:
            # grain seeds epoch e with base + e: spread the bases so runs with seeds s and s + 1 do not
            # share epoch orders one epoch apart
            rows = rows.shuffle(seed=(self.seed * 0x9E3779B1 + 1) % 2**32)
        return rows.repeat()

    def dataset(self, batch_size: int, rows: Sequence[int], offset: int = 0) -> grain.MapDataset:
        """Element s: {"tokens": the given `rows` of global batch s}, shape (len(rows), seq_len + 1): samples
        offset + s * batch_size + row of the stream (a run resumed with another batch size shifts them)."""
        samples, rows = self.samples(), list(rows)
        return grain.MapDataset.range(0, sys.maxsize).map(
            lambda step: {"tokens": np.stack([samples[offset + step * batch_size + r] for r in rows])}
        )

    def state(self) -> dict:
        """What the batches depend on besides the step (saved with checkpoints, checked on resume by
        `data_changes`): the data's content, not where it lies ("dir" only says where it was read)."""
        return {
            "dir": str(self.directory.absolute()),
            "rows": len(self.windows),
            "tokens": len(self.windows.tokens),
            "content": content_id(self.directory),
            "seed": self.seed,  # the order of the rows
        }


def data_changes(saved: dict, now: dict) -> list[str]:
    """The keys of a checkpoint's data state (`state()`) whose values differ now, as "key: old -> new".
    The directory is left out (moved data is the same data); a key an older jaxdist did not record
    ("content") is not compared."""
    return [f"{k}: {saved[k]} -> {now.get(k)}" for k in sorted(saved) if k != "dir" and saved[k] != now.get(k)]


class StepData:
    """grain view of a source with `batch(step, batch_size) -> dict` (the synthetic one)."""

    def __init__(self, source):
        self.source, self.width = source, source.seq_len + 1

    def dataset(self, batch_size: int, rows: Sequence[int], offset: int = 0) -> grain.MapDataset:
        """Element s: the given `rows` of `source.batch(s)`: drawn afresh for each step, whatever the batch
        size, so `offset` (where a stream of samples would continue) has nothing to shift."""
        rows = np.asarray(rows)
        return grain.MapDataset.range(0, sys.maxsize).map(
            lambda step: {k: v[rows] for k, v in self.source.batch(step, batch_size).items()}
        )

    def state(self) -> dict:
        return {"source": type(self.source).__name__, "seed": self.source.seed}


class Loader:
    """Global batches of one process: its rows read by grain on background threads, placed on its devices."""

    def __init__(self, data, batch_size: int, sharding: jax.sharding.Sharding, threads: int = 2, prefetch: int = 4):
        self.data, self.batch_size, self.sharding = data, batch_size, sharding
        self.read_options = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch)
        self.shape = (batch_size, data.width)
        self.rows = device_rows(sharding, self.shape, sharding.addressable_devices)
        self.position = {row: i for i, row in enumerate(self.rows)}

    def local_batches(self, start: int, offset: int = 0) -> Iterator[dict]:
        """This process's rows of the batches of steps start, start + 1, ... (numpy, prefetched); `offset`
        shifts the samples (see `ShardData.dataset`)."""
        dataset = self.data.dataset(self.batch_size, self.rows, offset)[start:]
        return iter(dataset.to_iter_dataset(self.read_options))

    def batches(self, start: int, offset: int = 0) -> Iterator[dict]:
        """The global batches of steps start, start + 1, ... as sharded jax.Arrays."""
        for local in self.local_batches(start, offset):
            yield self.place(local)

    def place(self, local: dict) -> dict:
        """This process's rows -> global arrays (each device gets its slice of them)."""

        def piece(v, idx):
            mine = [self.position[r] for r in range(self.batch_size)[idx[0]]]
            return v[mine][(slice(None), *idx[1:])]

        return {
            k: jax.make_array_from_callback((self.batch_size, *v.shape[1:]), self.sharding, lambda i, v=v: piece(v, i))
            for k, v in local.items()
        }
