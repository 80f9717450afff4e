"""Training data: prepared token shards (data.source = shards, or text prepared on the fly) and a
synthetic stream, all read through grain (jaxdist.train.data.shards).

A batch depends only on the seed and the step number, so a resumed run sees
exactly the batches the uninterrupted run would have, and every process reads
just its own rows of the global batch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxdist.train.config import DataConfig
from jaxdist.train.data.prepare import ensure_prepared
from jaxdist.train.data.shards import ShardData, StepData, read_index
from jaxdist.train.process_zero import on_process_zero

CORPUS = Path(__file__).parent / "corpus" / "river.txt"
VAL_SEED_OFFSET = 1_000_003  # synthetic validation batches: another seed


class SyntheticData:
    """Sequences that count up from a random start modulo the vocabulary: learnable, no file."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def batch(self, step: int, batch_size: int, rows: slice = slice(None)) -> dict:
        rng = np.random.default_rng([self.seed, step])
        start = rng.integers(0, self.vocab_size, (batch_size, 1))[rows]
        return {"tokens": ((start + np.arange(self.seq_len + 1)) % self.vocab_size).astype(np.int32)}


def make(data: DataConfig, split: str, vocab_size: int, seq_len: int, seed: int, out_dir: Path, progress: bool):
    """The `split` ("train" or "val") of the configured data, as a grain-readable source.

    `text` prepares data.path into out_dir/data (bytes or data.tokenizer) on first use, then
    reads it like `shards`; `synthetic` draws validation batches from another seed.
    """
    if data.source == "synthetic":
        return StepData(SyntheticData(vocab_size, seq_len, seed if split == "train" else seed + VAL_SEED_OFFSET))
    if data.source == "text":
        path = Path(data.path) if data.path else CORPUS
        if path.is_dir():
            raise ValueError(f"data.path {path} is a directory; set data.path to a text file")
        if not path.is_file():
            raise ValueError(f"data file {path} does not exist; set data.path to a text file")
        directory = out_dir / "data"
        # the others read what process 0 writes, once it has (or stop with its error)
        on_process_zero(
            lambda: ensure_prepared(
                [path], directory, tokenizer=data.tokenizer, val_fraction=data.val_fraction, progress=progress
            ),
            f"preparing {path}",
        )
    elif data.source == "shards":
        if not data.path:
            raise ValueError("data.source=shards needs data.path=DIR, a directory made by jaxdist prepare-data")
        directory = Path(data.path)
    else:
        raise ValueError(f"unknown data.source {data.source!r}; choose text, shards or synthetic")
    vocab = read_index(directory)["vocab_size"]
    if vocab > vocab_size:
        raise ValueError(
            f"the data's tokenizer has {vocab} tokens but model.vocab_size={vocab_size}; "
            f"set model.vocab_size >= {vocab}"
        )
    # validation: disjoint sequences in order, whatever data.stride says for training
    stride = (data.stride or seq_len) if split == "train" else seq_len
    return ShardData(directory, split, seq_len, seed, stride, shuffle=split == "train")
