"""A resumed run continues the data stream exactly where it stopped, also on another layout (the batch
split over other devices) and with another batch size: each step trains on the next samples of the
uninterrupted stream, none repeated or skipped."""

import numpy as np

from jaxdist.train import config as config_lib
from jaxdist.train import hooks
from jaxdist.train.data import CORPUS
from jaxdist.train.prepare import prepare
from jaxdist.train.shards import ShardData
from jaxdist.train.trainer import train

BASE = ["model.flavor=tiny", "model.n_layers=1", "run.progress=false", "run.steps=3", "data.source=shards"]


def test_a_run_resumed_on_another_layout_and_batch_size_reads_the_next_samples_of_the_stream(tmp_path, monkeypatch):
    prepare([CORPUS], tmp_path / "d", progress=False)
    seen: dict[int, list[np.ndarray]] = {}
    original = hooks.Loader.batches

    def recording(self, start, *args, **kwargs):
        for step, batch in enumerate(original(self, start, *args, **kwargs), start):
            seen.setdefault(step, []).append(np.asarray(batch["tokens"]))  # the global batch that step trains on
            yield batch

    monkeypatch.setattr(hooks.Loader, "batches", recording)
    over = [f"data.path={tmp_path / 'd'}", "data.stride=16", f"run.out_dir={tmp_path / 'run'}"]
    train(config_lib.load(None, [*BASE, *over, "data.batch_size=8"]), stop_after=1)  # 8 data-parallel ranks
    train(config_lib.load(None, [*BASE, *over, "data.batch_size=16", "parallel.tp=2"]))  # 4 ranks x tp 2
    assert sorted(seen) == [0, 1, 2] and all(len(v) == 1 for v in seen.values())  # each step read once

    # reference: the sample stream itself, which knows nothing of steps, batch sizes or devices
    samples = ShardData(tmp_path / "d", "train", seq_len=64, seed=0, stride=16, shuffle=True).samples()
    for step, (first, size) in enumerate([(0, 8), (8, 16), (24, 16)]):
        np.testing.assert_array_equal(seen[step][0], np.stack([samples[k] for k in range(first, first + size)]))
    assert len({tuple(r) for step in range(3) for r in seen[step][0]}) == 40  # 40 distinct windows
