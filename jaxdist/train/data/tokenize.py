"""Tokenizers for training data: UTF-8 bytes, a Hugging Face `tokenizers` JSON file, or a BPE trained on the input.

A prepared data directory names its tokenizer in index.json ("bytes", or a
`tokenizer.json` saved next to the shards), so training, evaluation and
sampling all decode with exactly the tokenizer the data was made with.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

END_OF_TEXT = "<|endoftext|>"  # separates documents where the vocabulary has it (GPT-2's name)
TOKENIZER_FILE = "tokenizer.json"
MIN_BPE_VOCAB = 258  # the 256 bytes and two special tokens


class ByteTokenizer:
    """Bytes as tokens (vocabulary 256, no end-of-text token): a file's own bytes, whatever its
    encoding; text is encoded as UTF-8."""

    name = "bytes"
    vocab_size = 256
    end_of_text: int | None = None

    def encode(self, text: str | bytes) -> np.ndarray:
        raw = text if isinstance(text, bytes) else text.encode("utf-8")
        return np.frombuffer(raw, dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, tokens) -> str:
        return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


class JSONTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` (loaded from, and saved as, its JSON file)."""

    name = TOKENIZER_FILE

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.end_of_text = tokenizer.token_to_id(END_OF_TEXT)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encoded = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encoded]

    def decode(self, tokens) -> str:
        return self.tokenizer.decode([int(t) for t in tokens], skip_special_tokens=False)

    def save(self, path: Path) -> None:
        # sorted keys and no pretty-printing: the same tokenizer always gives the same bytes
        path.write_text(json.dumps(json.loads(self.tokenizer.to_str()), sort_keys=True))


def tokenizer_path(spec: str | Path) -> Path:
    """The tokenizer JSON file `spec` names: the file, or the tokenizer.json of a (hf:) model directory."""
    path = Path(str(spec).removeprefix("hf:"))
    return path / TOKENIZER_FILE if path.is_dir() else path


def from_file(path: str | Path) -> JSONTokenizer:
    """The Hugging Face tokenizer JSON file at `path`, or the tokenizer.json of a Hugging Face model
    directory (`DIR` or `hf:DIR`); one-line errors for a missing or invalid file."""
    from tokenizers import Tokenizer

    path = tokenizer_path(path)
    if not path.is_file():
        raise ValueError(f"tokenizer file {path} does not exist; give a Hugging Face tokenizer.json, or 'bytes'")
    try:
        return JSONTokenizer(Tokenizer.from_file(str(path)))
    except Exception as e:  # tokenizers raises plain Exceptions with multi-line text
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"tokenizer file {path} is not a Hugging Face tokenizer JSON ({first})") from None


def train_bpe(texts: Iterable[str], vocab_size: int) -> JSONTokenizer:
    """A byte-level BPE (GPT-2's scheme) with `vocab_size` entries learnt from `texts`, plus END_OF_TEXT."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_BPE_VOCAB:
        raise ValueError(
            f"--train-bpe {vocab_size} is too small; a byte-level BPE needs at least {MIN_BPE_VOCAB} (256 bytes + 2)"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return JSONTokenizer(tokenizer)


def load(directory: str | Path, name: str) -> ByteTokenizer | JSONTokenizer:
    """The tokenizer a data directory's index.json names: "bytes" or the JSON file in `directory`."""
    return ByteTokenizer() if name == ByteTokenizer.name else from_file(Path(directory) / name)
