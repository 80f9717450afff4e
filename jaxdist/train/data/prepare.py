"""`jaxdist prepare-data`: text files -> fixed-size binary shards of token ids plus a JSON index.

Layout of a data directory:

    index.json             tokenizer, vocabulary size, dtype, per split: shard files and token counts
    tokenizer.json         the Hugging Face tokenizer (absent for "bytes")
    train-00000.bin ...    token ids, little-endian uint16 (vocabulary <= 65536) or uint32, back to back
    val-00000.bin ...

Each input file is a document. Its last `val_fraction` (by bytes, cut at a line
break) goes to the validation split, the rest to the training split, so one
file is enough for both. Documents are separated by the tokenizer's
`<|endoftext|>` where it has one. The output depends only on the inputs and the
options (fixed chunking, no timestamps), so preparing twice gives identical
files; it is written to a temporary directory and renamed when complete.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from jaxdist.train.data import tokenize
from jaxdist.train.report import disk_full, is_terminal, write_problem

FORMAT = "jaxdist-shards/1"
INDEX = "index.json"
SPLITS = ("train", "val")
CHUNK_BYTES = 1 << 20  # text is tokenized in chunks of about this size, cut at line breaks
ENCODE_BATCH = 16  # chunks handed to the tokenizer at once
DEFAULT_SHARD_TOKENS = 1 << 27  # 256 MiB of uint16 per shard
PLAIN_EVERY_S = 30.0  # without a terminal: a progress line this often


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32).newbyteorder("<")


class ShardWriter:
    """Appends token ids to `{split}-NNNNN.bin` files of `shard_tokens` tokens each (the last may be shorter)."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self.file = None

    def write(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids).astype(self.dtype)
        while ids.size:
            if self.file is None or self.shards[-1]["tokens"] == self.shard_tokens:
                self._next_shard()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            self.file.write(ids[:room].tobytes())
            self.shards[-1]["tokens"] += len(ids[:room])
            ids = ids[room:]

    def _next_shard(self) -> None:
        if self.file is not None:
            self.file.close()
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self.file = (self.directory / name).open("wb")
        self.shards.append({"file": name, "tokens": 0})

    def close(self) -> dict:
        if self.file is not None:
            self.file.close()
        return {"tokens": sum(s["tokens"] for s in self.shards), "shards": self.shards}


def _val_cut(path: Path, size: int, val_fraction: float) -> int:
    """The byte offset where the validation part of a file starts: after the first line break at or
    past (1 - val_fraction) of it, or exactly there (on a character boundary) if no line ends soon."""
    if val_fraction <= 0:
        return size
    at = min(size, int(size * (1 - val_fraction)))
    with path.open("rb") as f:
        f.seek(at)
        ahead = f.read(1 << 16)
    newline = ahead.find(b"\n")
    if newline >= 0:
        return at + newline + 1
    inside = 0
    while inside < len(ahead) and (ahead[inside] & 0xC0) == 0x80:  # UTF-8 continuation bytes
        inside += 1
    return at + inside


def _chunks(path: Path, start: int, end: int, as_text: bool = True) -> Iterator[str | bytes]:
    """The text of bytes [start, end) of `path` in pieces of about CHUNK_BYTES, each ending at a line break
    (the raw bytes with `as_text=False`: a byte-level tokenizer reads any file, whatever its encoding)."""
    with path.open("rb") as f:
        f.seek(start)
        pos = start
        while pos < end:
            data = f.read(min(CHUNK_BYTES, end - pos))
            if pos + len(data) < end:
                data += f.readline(end - pos - len(data))
            offset = pos
            pos += len(data)
            if not as_text:
                yield data
                continue
            try:
                yield data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"input {path} is not UTF-8 text (bad byte at offset {offset + e.start}); convert it to UTF-8"
                ) from None


def _inputs(paths: Sequence[str | Path]) -> list[Path]:
    if not paths:
        raise ValueError("no input files; give one or more text files")
    files = [Path(p) for p in paths]
    for f in files:
        if not f.is_file():
            raise ValueError(f"input {f} does not exist or is not a file; give text files")
    if sum(f.stat().st_size for f in files) == 0:
        raise ValueError(f"the input{'s are' if len(files) > 1 else ' is'} empty; give text files with some text")
    return files


def _tokenizer(spec: str, train_bpe: int, files: list[Path], cuts: list[int]):
    if train_bpe:
        # learnt on the training part only, so validation text stays unseen
        texts = (text for f, cut in zip(files, cuts, strict=True) for text in _chunks(f, 0, cut))
        return tokenize.train_bpe(texts, train_bpe), f"bpe:{train_bpe}"
    if spec == "bytes":
        return tokenize.ByteTokenizer(), "bytes"
    return tokenize.from_file(spec), str(Path(spec).absolute())


def _sha256(f: Path) -> str:
    digest = hashlib.sha256()
    with f.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def source_record(files: Sequence[Path]) -> list[dict]:
    """What the output depends on in the inputs: path, size and SHA-256 of each."""
    return [{"path": str(f.absolute()), "bytes": f.stat().st_size, "sha256": _sha256(f)} for f in files]


def tokenizer_sha256(spec: str, train_bpe: int) -> str | None:
    """The SHA-256 of a tokenizer given as a file (its path alone would not see the file replaced)."""
    if train_bpe or spec == "bytes" or not (path := tokenize.tokenizer_path(spec)).is_file():
        return None  # (a missing file: `prepare` says so)
    return _sha256(path)


def prepare(
    inputs: Sequence[str | Path],
    out: str | Path,
    *,
    tokenizer: str = "bytes",
    train_bpe: int = 0,
    val_fraction: float = 0.1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress: bool = True,
    replace: bool = False,
) -> dict:
    """Tokenize `inputs` into shards in `out`; returns the index (also written to out/index.json).

    Args:
      inputs: text files (UTF-8), each one document.
      out: the directory to create; an existing non-empty one is an error unless `replace`.
      tokenizer: "bytes" or the path of a Hugging Face tokenizer JSON file.
      train_bpe: if > 0, learn a byte-level BPE of this vocabulary size on the training part instead.
      val_fraction: the share of each file (its end) that goes to the validation split.
      shard_tokens: tokens per shard file.
    """
    out = Path(out)
    if not 0 <= val_fraction < 1:
        raise ValueError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if train_bpe and tokenizer != "bytes":
        raise ValueError("give --tokenizer FILE or --train-bpe VOCAB, not both")
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens must be >= 1, got {shard_tokens}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give the directory to write (one that does not exist or is empty)")
    if out.exists() and any(out.iterdir()) and not replace:
        raise ValueError(f"{out} exists and is not empty; remove it or choose another --out")
    files = _inputs(inputs)
    sizes = [f.stat().st_size for f in files]
    cuts = [_val_cut(f, size, val_fraction) for f, size in zip(files, sizes, strict=True)]
    tok, tokenizer_source = _tokenizer(tokenizer, train_bpe, files, cuts)
    dtype = token_dtype(tok.vocab_size)

    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise ValueError(f"cannot write {out} ({e.strerror}); choose an --out you can write to") from None
    try:
        writers = {split: ShardWriter(tmp, split, dtype, shard_tokens) for split in SPLITS}
        bar = _bar(sum(sizes), progress)
        for f, cut, size in zip(files, cuts, sizes, strict=True):
            for split, (start, end) in zip(SPLITS, [(0, cut), (cut, size)], strict=True):
                if start == end:
                    continue
                chunks = _chunks(f, start, end, as_text=not isinstance(tok, tokenize.ByteTokenizer))
                while texts := list(itertools.islice(chunks, ENCODE_BATCH)):
                    for ids in tok.encode_batch(texts):  # the tokenizers library encodes a batch in parallel
                        writers[split].write(ids)
                    bar.update(sum(len(t) if isinstance(t, bytes) else len(t.encode("utf-8")) for t in texts))
                if tok.end_of_text is not None:
                    writers[split].write(np.array([tok.end_of_text]))
        bar.close()
        splits = {split: w.close() for split, w in writers.items()}
        if splits["train"]["tokens"] == 0:
            raise ValueError("the inputs give no training tokens; give more text or a smaller --val-fraction")
        if isinstance(tok, tokenize.JSONTokenizer):
            tok.save(tmp / tokenize.TOKENIZER_FILE)
        index = {
            "format": FORMAT,
            "tokenizer": tok.name,
            "tokenizer_source": tokenizer_source,
            "tokenizer_sha256": tokenizer_sha256(tokenizer, train_bpe),
            "vocab_size": tok.vocab_size,
            "end_of_text": tok.end_of_text,
            "dtype": dtype.name,
            "shard_tokens": shard_tokens,
            "val_fraction": val_fraction,
            "inputs": source_record(files),
            "splits": splits,
        }
        (tmp / INDEX).write_text(json.dumps(index, indent=1) + "\n")
        if replace:
            shutil.rmtree(out, ignore_errors=True)
        elif out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except OSError as e:
        if not disk_full(e):
            raise
        # the partial shards go with `tmp`, below
        raise ValueError(f"could not write {out}: {write_problem(e, out.absolute().parent)}; free some space") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return index


class _bar:
    """Progress over input bytes: a tqdm bar on a terminal; elsewhere (a log file, a pipe) plain lines, one
    every PLAIN_EVERY_S seconds and one at the end, as the trainer's bar does; or nothing."""

    def __init__(self, total: int, enabled: bool):
        self.tqdm, self.total, self.done = None, total, 0
        self.stream = sys.stderr
        self.plain = enabled and not is_terminal(self.stream)
        self.last_line = time.monotonic()
        if enabled and not self.plain:
            from tqdm import tqdm

            self.tqdm = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", dynamic_ncols=True)

    def update(self, n: int) -> None:
        self.done += n
        if self.tqdm is not None:
            self.tqdm.update(n)
        elif self.plain and time.monotonic() - self.last_line >= PLAIN_EVERY_S:
            self._line()

    def close(self) -> None:
        if self.tqdm is not None:
            self.tqdm.close()
        elif self.plain:
            self._line()

    def _line(self) -> None:
        from tqdm import tqdm

        done, total = (tqdm.format_sizeof(n, "B") for n in (self.done, self.total))
        share = self.done / self.total if self.total else 1.0
        print(f"tokenizing: {done} of {total} ({share:.0%})", file=self.stream, flush=True)
        self.last_line = time.monotonic()


def ensure_prepared(
    inputs: Sequence[str | Path], out: str | Path, *, tokenizer: str, val_fraction: float, progress: bool
) -> Path:
    """`out` prepared from `inputs` with these options: reused if its index says it is, else (re)made.

    Used by `data.source = "text"`, which prepares the text into the run directory.
    """
    out = Path(out)
    train_bpe = 0
    if tokenizer.startswith("bpe:"):
        try:
            train_bpe = int(tokenizer[4:])
        except ValueError:
            train_bpe = -1
        if train_bpe < tokenize.MIN_BPE_VOCAB:  # the run's settings named, not prepare-data's flags
            raise ValueError(
                f"data.tokenizer={tokenizer!r}: write bpe:N with a vocabulary size N >= {tokenize.MIN_BPE_VOCAB} "
                "(bpe:512)"
            )
    if not 0 <= val_fraction < 1:
        raise ValueError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
    spec = "bytes" if train_bpe else tokenizer
    files = _inputs(inputs)
    source = f"bpe:{train_bpe}" if train_bpe else (spec if spec == "bytes" else str(Path(spec).absolute()))
    # the inputs by content: the same text moved or renamed prepares the same shards, so they are reused

    def contents(inputs):
        return [{k: v for k, v in f.items() if k != "path"} for f in inputs]

    wanted = {
        "inputs": contents(source_record(files)),
        "tokenizer_source": source,
        "tokenizer_sha256": tokenizer_sha256(spec, train_bpe),  # the file replaced: prepared again
        "val_fraction": val_fraction,
    }
    index_path = out / INDEX
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
        except ValueError:  # damaged (an interrupted copy): prepared again below
            index = {}
        index = index if isinstance(index, dict) else {}
        index["inputs"] = contents(index.get("inputs", []))
        if all(index.get(k) == v for k, v in wanted.items()):
            return out
    _check_only_prepared_data(out)
    prepare(files, out, tokenizer=spec, train_bpe=train_bpe, val_fraction=val_fraction, progress=progress, replace=True)
    return out


def _check_only_prepared_data(out: Path) -> None:
    """Refuse to replace a directory that holds files `prepare` does not write (a user's own `data/`
    under a run directory chosen by mistake): replacing it would delete them."""
    if not out.is_dir():
        return
    shard = re.compile(rf"({'|'.join(SPLITS)})-\d{{5}}\.bin")
    ours = (INDEX, tokenize.TOKENIZER_FILE)
    foreign = sorted(  # hidden names are the system's (.DS_Store, ._index.json, .nfs*), not someone's data
        p.name
        for p in out.iterdir()
        if p.name not in ours and not shard.fullmatch(p.name) and not p.name.startswith(".")
    )
    if foreign:
        listed = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ValueError(
            f"{out} holds files jaxdist did not write ({listed}); data.source=text prepares its shards into the "
            "run directory's data/ and would replace them: choose another run.out_dir, or move them elsewhere"
        )
