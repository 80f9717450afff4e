"""A resumed run continues the data stream exactly where it stopped, also on another layout (the batch
split over other devices), with another batch size and with the data moved to another directory: each
step trains on the next samples of the uninterrupted stream, none repeated or skipped, and the moved data
is recognised as the same data."""

import shutil

import numpy as np
import pytest

from jaxdist.train import config as config_lib
from jaxdist.train import hooks
from jaxdist.train.data.prepare import prepare
from jaxdist.train.data.shards import ShardData
from jaxdist.train.data.sources import CORPUS
from jaxdist.train.sample import load_run
from jaxdist.train.trainer import train

# the tiny model as the other batch-8 tiny runs train it (tests/train/test_metrics_rows.py): the first part's
# step is their program, compiled once per test run
BASE = ["model.flavor=tiny", "run.progress=false", "run.steps=3", "data.source=shards"]


def test_a_run_resumed_on_another_layout_and_batch_size_and_moved_data_reads_the_next_samples(
    tmp_path, monkeypatch, capfd
):
    prepare([CORPUS], tmp_path / "d", progress=False)
    seen: dict[int, list[np.ndarray]] = {}
    original = hooks.Loader.batches

    def recording(self, start, *args, **kwargs):
        for step, batch in enumerate(original(self, start, *args, **kwargs), start):
            seen.setdefault(step, []).append(np.asarray(batch["tokens"]))  # the global batch that step trains on
            yield batch

    monkeypatch.setattr(hooks.Loader, "batches", recording)
    out, over = tmp_path / "run", ["data.stride=16", f"run.out_dir={tmp_path / 'run'}"]
    train(config_lib.load(None, [*BASE, *over, f"data.path={tmp_path / 'd'}", "data.batch_size=8"]), stop_after=1)
    moved = shutil.move(tmp_path / "d", tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=f"data directory {tmp_path / 'd'} the run trained on .* is gone; give where"):
        load_run(out)  # `jaxdist sample` needs the data's tokenizer: it says how to point at the moved data
    assert load_run(out, moved)[1].vocab_size == 256
    capfd.readouterr()
    # 8 data-parallel ranks, then 4 ranks x tp 2, twice the batch, the data elsewhere
    train(config_lib.load(None, [*BASE, *over, f"data.path={moved}", "data.batch_size=16", "parallel.tp=2"]))
    said = "".join(capfd.readouterr())
    assert "resumed from" in said and "data changed" not in said
    assert sorted(seen) == [0, 1, 2] and all(len(v) == 1 for v in seen.values())  # each step read once

    # reference: the sample stream itself, which knows nothing of steps, batch sizes or devices
    samples = ShardData(moved, "train", seq_len=64, seed=0, stride=16, shuffle=True).samples()
    for step, (first, size) in enumerate([(0, 8), (8, 16), (24, 16)]):
        np.testing.assert_array_equal(seen[step][0], np.stack([samples[k] for k in range(first, first + size)]))
    assert len({tuple(r) for step in range(3) for r in seen[step][0]}) == 40  # 40 distinct windows


def test_where_the_stream_continues_is_read_from_the_checkpoint_or_derived_for_an_older_one():
    assert hooks.samples_before(None, 0, 16) == 0  # a new run
    assert hooks.samples_before({"data_samples": 40, "config": {"data": {"batch_size": 8}}}, 3, 16) == 40
    # a checkpoint of an older jaxdist records no samples: its steps read its own batch size each
    assert hooks.samples_before({"config": {"data": {"batch_size": 8}}}, 5, 16) == 40
