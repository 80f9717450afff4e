"""Training data: a byte-level text stream and a synthetic one, both a pure function of (seed, step).

A batch depends only on the seed and the step number, so a resumed run sees
exactly the batches the uninterrupted run would have, and every process can
build just its own rows of the global batch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CORPUS = Path(__file__).parent / "corpus" / "river.txt"
BYTE_VOCAB = 256


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256)."""

    vocab_size = BYTE_VOCAB

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, tokens) -> str:
        return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


class TextData:
    """Random windows of `seq_len + 1` tokens from a text file, byte-level."""

    def __init__(self, path: str | Path | None, seq_len: int, seed: int):
        path = Path(path) if path else CORPUS
        if path.is_dir():
            raise ValueError(f"data.path {path} is a directory; set data.path to a text file")
        if not path.is_file():
            raise ValueError(f"data file {path} does not exist; set data.path to a text file")
        # byte-level: the file's bytes are the tokens, whatever its encoding
        self.tokens = np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.int32)
        if len(self.tokens) <= seq_len + 1:
            raise ValueError(f"data file {path} has {len(self.tokens)} bytes, fewer than model.seq_len + 2")
        self.seq_len, self.seed = seq_len, seed

    def batch(self, step: int, batch_size: int, rows: slice = slice(None)) -> dict:
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, batch_size)[rows]
        return {"tokens": np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts])}


class SyntheticData:
    """Sequences that count up from a random start modulo the vocabulary: learnable, no file."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def batch(self, step: int, batch_size: int, rows: slice = slice(None)) -> dict:
        rng = np.random.default_rng([self.seed, step])
        start = rng.integers(0, self.vocab_size, (batch_size, 1))[rows]
        return {"tokens": ((start + np.arange(self.seq_len + 1)) % self.vocab_size).astype(np.int32)}


def make(source: str, path: str, vocab_size: int, seq_len: int, seed: int):
    if source == "text":
        if vocab_size < BYTE_VOCAB:
            raise ValueError(
                f"byte-level text needs model.vocab_size >= 256, got {vocab_size}; set model.vocab_size=256"
            )
        return TextData(path, seq_len, seed)
    if source == "synthetic":
        return SyntheticData(vocab_size, seq_len, seed)
    raise ValueError(f"unknown data.source {source!r}; choose text or synthetic")
