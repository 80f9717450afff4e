"""The data pipeline: prepared shards, the grain loader, per-process rows, exact resume, validation loss, errors."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.train import config as config_lib
from jaxdist.train.config import ConfigError
from jaxdist.train.data.prepare import ShardWriter, prepare, token_dtype
from jaxdist.train.data.shards import Loader, ShardData, TokenShards, device_rows
from jaxdist.train.data.sources import CORPUS
from jaxdist.train.data.tokenize import END_OF_TEXT
from jaxdist.train.trainer import train

REPO = Path(__file__).resolve().parents[3]
TEXT = CORPUS.read_text(encoding="utf-8")


def test_shard_writer_and_reader_round_trip_across_shard_boundaries(tmp_path):
    ids = np.random.default_rng(0).integers(0, 2**16, 1000)
    writer = ShardWriter(tmp_path, "train", token_dtype(2**16), shard_tokens=64)
    for piece in np.split(ids, [5, 200, 201, 700]):  # writes that straddle shard ends
        writer.write(piece)
    split = writer.close()
    assert [s["tokens"] for s in split["shards"]] == [64] * 15 + [40]
    assert [(tmp_path / s["file"]).stat().st_size for s in split["shards"]] == [128] * 15 + [80]
    (tmp_path / "index.json").write_text(
        json.dumps({"format": "jaxdist-shards/1", "dtype": "uint16", "vocab_size": 2**16, "splits": {"train": split}})
    )
    tokens = TokenShards(tmp_path, "train")
    np.testing.assert_array_equal(tokens.read(0, 1000), ids)
    for start, length in [(0, 1), (63, 2), (64, 64), (100, 500), (999, 1)]:
        np.testing.assert_array_equal(tokens.read(start, length), ids[start : start + length])


def _counting_shards(directory: Path, n: int, shard_tokens: int) -> None:
    """A train split whose token at position i is i: a row's first token is where it starts."""
    directory.mkdir()
    writer = ShardWriter(directory, "train", token_dtype(2**16), shard_tokens)
    writer.write(np.arange(n))
    index = {"format": "jaxdist-shards/1", "dtype": "uint16", "vocab_size": 2**16, "splits": {"train": writer.close()}}
    (directory / "index.json").write_text(json.dumps(index))


def test_prepared_bytes_are_the_text_exactly(tmp_path):
    prepare([CORPUS], tmp_path / "d", shard_tokens=1000, val_fraction=0.2, progress=False)
    train_ids = TokenShards(tmp_path / "d", "train").read(0, len(TokenShards(tmp_path / "d", "train")))
    val_ids = TokenShards(tmp_path / "d", "val").read(0, len(TokenShards(tmp_path / "d", "val")))
    assert bytes(np.concatenate([train_ids, val_ids]).astype(np.uint8)) == CORPUS.read_bytes()
    text, cut = CORPUS.read_bytes(), len(train_ids)
    assert text[int(0.8 * len(text)) : cut].count(b"\n") == 1 and text[cut - 1 : cut] == b"\n"  # the next line break


def test_trained_bpe_round_trips_the_text_and_is_reproducible(tmp_path):
    other = tmp_path / "other.txt"
    other.write_text("".join(f"Line {i} of a second document.\n" for i in range(20)))
    for name in ("a", "b"):
        prepare([CORPUS, other], tmp_path / name, train_bpe=300, shard_tokens=500, progress=False)
    a, b = tmp_path / "a", tmp_path / "b"
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for f in a.iterdir():
        assert f.read_bytes() == (b / f.name).read_bytes(), f.name
    from jaxdist.train.data.shards import load_tokenizer

    tok = load_tokenizer(a)
    index = json.loads((a / "index.json").read_text())
    assert index["vocab_size"] == 300 and index["dtype"] == "uint16" and len(index["splits"]["train"]["shards"]) > 1
    eot = tok.tokenizer.token_to_id(END_OF_TEXT)
    texts = {}
    for split in ("train", "val"):
        ids = TokenShards(a, split).read(0, len(TokenShards(a, split)))
        ends = np.flatnonzero(ids == eot)
        assert len(ends) == 2 and ends[-1] == len(ids) - 1  # one after each document's part
        texts[split] = [tok.decode(doc[:-1]) for doc in np.split(ids, ends + 1)[:2]]
    assert texts["train"][0] + texts["val"][0] == TEXT and texts["val"][0]
    assert texts["train"][1] + texts["val"][1] == other.read_text() and texts["val"][1]


def test_a_tokenizer_file_with_a_large_vocabulary_gives_uint32_shards(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(70_000)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "big.json"))
    text = tmp_path / "in.txt"
    text.write_text("w1 w69999 w65536\nw3 w4\n")
    index = prepare([text], tmp_path / "d", tokenizer=str(tmp_path / "big.json"), val_fraction=0, progress=False)
    assert index["dtype"] == "uint32" and index["vocab_size"] == 70_000
    np.testing.assert_array_equal(TokenShards(tmp_path / "d", "train").read(0, 5), [1, 69999, 65536, 3, 4])


@pytest.mark.parametrize("mesh_shape", [((8,), ("dp",)), ((4, 2), ("dp", "tp")), ((2, 4), ("dp", "fsdp"))])
def test_two_simulated_processes_read_disjoint_rows_that_make_the_global_batch(tmp_path, mesh_shape):
    prepare([CORPUS], tmp_path / "d", progress=False)
    mesh = jax.make_mesh(*mesh_shape)
    batch_axes = tuple(a for a in mesh.axis_names if a != "tp")
    sharding = NamedSharding(mesh, P(batch_axes))
    devices = list(mesh.devices.flat)
    process_devices = [devices[:4], devices[4:]]  # as two 4-device processes would hold them
    rows = [device_rows(sharding, (16, 65), d) for d in process_devices]
    assert set(rows[0]).isdisjoint(rows[1]) and sorted(rows[0] + rows[1]) == list(range(16))
    data = ShardData(tmp_path / "d", "train", seq_len=64, seed=3, stride=64, shuffle=True)
    whole = data.dataset(16, range(16))
    for step in (0, 7):
        parts = [data.dataset(16, r)[step]["tokens"] for r in rows]
        np.testing.assert_array_equal(parts[0], whole[step]["tokens"][rows[0]])
        np.testing.assert_array_equal(parts[1], whole[step]["tokens"][rows[1]])


@pytest.mark.parametrize("stride", [16, 5])
def test_samples_are_windows_each_seen_once_per_epoch_in_a_new_order(tmp_path, stride):
    _counting_shards(tmp_path / "d", 1000, shard_tokens=100)
    data = ShardData(tmp_path / "d", "train", seq_len=16, seed=0, stride=stride, shuffle=True)
    rows = len(data.windows)
    assert rows == (1000 - 17) // stride + 1
    samples = [data.samples()[k] for k in range(2 * rows)]
    for s in samples:
        np.testing.assert_array_equal(s, np.arange(s[0], s[0] + 17))  # a window, across shard ends too
    epochs = [[int(s[0]) for s in samples[:rows]], [int(s[0]) for s in samples[rows:]]]
    assert sorted(epochs[0]) == sorted(epochs[1]) == [stride * r for r in range(rows)]  # each row once per epoch
    assert epochs[0] != epochs[1] and epochs[0] != sorted(epochs[0])  # shuffled, and again each epoch


def test_resumed_loader_gives_the_batches_of_an_uninterrupted_one_for_any_process_count(tmp_path):
    prepare([CORPUS], tmp_path / "d", progress=False)
    data = ShardData(tmp_path / "d", "train", seq_len=32, seed=5, stride=32, shuffle=True)
    one_process = NamedSharding(jax.make_mesh((8,), ("dp",)), P("dp"))
    stream = Loader(data, 16, one_process).batches(0)
    uninterrupted = [np.asarray(next(stream)["tokens"]) for _ in range(12)]
    assert len({b.tobytes() for b in uninterrupted}) == 12
    resumed = Loader(data, 16, one_process).batches(7)  # the state a checkpoint at step 7 restores: the step
    for step in range(7, 12):
        np.testing.assert_array_equal(np.asarray(next(resumed)["tokens"]), uninterrupted[step])
    # after a change to two processes: each reads its rows from step 7, together the same global batches
    devices = list(one_process.mesh.devices.flat)
    halves = [device_rows(one_process, (16, 33), d) for d in (devices[:4], devices[4:])]
    streams = [iter(data.dataset(16, rows)[7:].to_iter_dataset()) for rows in halves]
    for step in range(7, 12):
        local = [next(s)["tokens"] for s in streams]
        np.testing.assert_array_equal(np.concatenate(local), uninterrupted[step][halves[0] + halves[1]])


BASE = ["model.flavor=tiny", "data.batch_size=16", "run.log_every=1", "run.progress=false", "optim.warmup_steps=2"]


def test_validation_loss_is_the_mean_cross_entropy_of_the_validation_rows(tmp_path):
    data_dir = tmp_path / "d"
    prepare([CORPUS], data_dir, val_fraction=0.5, shard_tokens=700, progress=False)
    out = tmp_path / "run"
    over = ["data.source=shards", f"data.path={data_dir}", "parallel.tp=2", "run.steps=2", "run.eval_every=2"]
    over += ["optim.decay_steps=6"]  # tests/train/test_train.py's dp x tp program (the schedule is compiled in)
    cfg = config_lib.load(None, [*BASE, *over, "run.eval_batches=3", f"run.out_dir={out}"])
    train(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "val_loss" not in rows[0] and "val_loss" in rows[-1]

    # reference: the step-2 parameters, the validation rows read straight from the files, numpy cross-entropy
    from jaxdist.train.sample import load_run

    model, _, step = load_run(out)
    assert step == 2
    val = np.concatenate([np.fromfile(f, "<u2") for f in sorted(data_dir.glob("val-*.bin"))]).astype(np.int32)
    n_rows = (len(val) - 65) // 64 + 1
    tokens = np.stack([val[k * 64 :][:65] for k in range(min(3 * 16, n_rows))])  # 3 batches' rows, each once
    logits = np.asarray(model(tokens[:, :-1]), np.float64)
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, tokens[:, 1:, None], -1).mean()
    np.testing.assert_allclose(rows[-1]["val_loss"], expected, rtol=2e-6)

    from jaxdist.train.plot import plot

    assert plot(str(out)) == 0 and (out / "curves.png").is_file()


def _one_line_error(fn, match):
    with pytest.raises(ValueError, match=match) as e:
        fn()
    assert "\n" not in str(e.value)


def test_bad_inputs_give_one_line_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    not_json = tmp_path / "bad.json"
    not_json.write_text("{not a tokenizer")
    _one_line_error(lambda: prepare([empty], tmp_path / "a", progress=False), "the input is empty")
    _one_line_error(lambda: prepare([tmp_path / "nope.txt"], tmp_path / "b"), "input .*nope.txt does not exist")
    _one_line_error(
        lambda: prepare([CORPUS], tmp_path / "c", tokenizer=str(tmp_path / "no.json")),
        "tokenizer file .*no.json does not exist; give a Hugging Face tokenizer.json",
    )
    _one_line_error(
        lambda: prepare([CORPUS], tmp_path / "d", tokenizer=str(not_json)), "is not a Hugging Face tokenizer JSON"
    )
    prepare([CORPUS], tmp_path / "bpe", train_bpe=300, progress=False)
    _one_line_error(lambda: prepare([CORPUS], tmp_path / "bpe"), "exists and is not empty")
    cfg = config_lib.load(None, [*BASE, "data.source=shards", f"data.path={tmp_path / 'bpe'}", "run.steps=1"])
    with pytest.raises(ConfigError, match="tokenizer has 300 tokens but model.vocab_size=256; set model.vocab_size"):
        train(cfg)
    cfg = config_lib.load(None, [*BASE, "data.source=shards", f"data.path={tmp_path}", "run.steps=1"])
    with pytest.raises(ConfigError, match="has no index.json; make it with: jaxdist prepare-data"):
        train(cfg)


def test_prepare_data_cli_reports_errors_on_one_line(tmp_path):
    cli = [sys.executable, "-m", "jaxdist.train.cli", "prepare-data"]
    bad = subprocess.run(
        [*cli, str(CORPUS), "--tokenizer", "missing.json", "--out", str(tmp_path / "x")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "missing.json does not exist" in bad.stderr
    ok = subprocess.run([*cli, str(CORPUS), "--out", str(tmp_path / "y"), "--quiet"], cwd=REPO, capture_output=True,
                        text=True, timeout=120)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert "vocabulary 256 (bytes), train 5," in ok.stdout
