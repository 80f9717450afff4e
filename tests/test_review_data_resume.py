"""A resumed run continues the data stream exactly where it stopped, also on another layout (the batch
split over other devices): each step trains on the global batch of the uninterrupted stream, no sequence
repeated or skipped."""

import numpy as np

from jaxdist.train import config as config_lib
from jaxdist.train import hooks
from jaxdist.train.data import CORPUS
from jaxdist.train.prepare import prepare
from jaxdist.train.shards import ShardData
from jaxdist.train.trainer import train

BASE = ["model.flavor=tiny", "model.n_layers=1", "data.batch_size=8", "run.progress=false", "run.steps=3"]


def test_a_run_resumed_on_another_layout_reads_the_batches_of_the_uninterrupted_stream(tmp_path, monkeypatch):
    prepare([CORPUS], tmp_path / "d", progress=False)
    seen: dict[int, np.ndarray] = {}
    original = hooks.Loader.batches

    def recording(self, start):
        for step, batch in enumerate(original(self, start), start):
            seen.setdefault(step, []).append(np.asarray(batch["tokens"]))  # the global batch that step trains on
            yield batch

    monkeypatch.setattr(hooks.Loader, "batches", recording)
    over = ["data.source=shards", f"data.path={tmp_path / 'd'}", "data.stride=16", f"run.out_dir={tmp_path / 'run'}"]
    train(config_lib.load(None, [*BASE, *over]), stop_after=1)  # 8 data-parallel ranks
    train(config_lib.load(None, [*BASE, *over, "parallel.tp=2"]))  # resumed at step 1 on 4 ranks x tp 2
    assert sorted(seen) == [0, 1, 2] and all(len(v) == 1 for v in seen.values())  # each step read once

    data = ShardData(tmp_path / "d", "train", seq_len=64, seed=0, stride=16, shuffle=True)
    stream = data.dataset(8, range(8))
    for step in range(3):
        np.testing.assert_array_equal(seen[step][0], stream[step]["tokens"])
    starts = [int(r[0]) for step in range(3) for r in seen[step][0]]  # 24 draws of the first epoch's order
    assert len(data.windows) > 24
    rows = {tuple(r) for step in range(3) for r in seen[step][0]}
    assert len(rows) == 24, f"a sequence repeated across the resume: {starts}"
