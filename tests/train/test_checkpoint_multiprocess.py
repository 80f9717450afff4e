"""A checkpoint saved by 2 processes x 4 devices (ZeRO-1, each process writing its own shards)
restores in 1 process x 8 devices onto another layout (DP x TP), and the run continues as an
uninterrupted one there (losses rtol 1e-5: two processes reduce in another order on CPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.trainer_runs import BASE as TRAIN_BASE

from jaxdist.train import config as config_lib
from jaxdist.train.trainer import train

REPO = Path(__file__).resolve().parents[2]
# the schedule of the whole run also for the 2-step first part; 6 steps long, as tests/train/test_train.py's
# dp x tp runs (the schedule is compiled in): the one-process dp x tp runs here are that program, compiled once
BASE = [*TRAIN_BASE, "optim.decay_steps=6"]


# two launches of 2 processes (~1 min): with the slow tests, beside the trainer's whole loop over 2 processes;
# the fast run launches 2 processes in tests/train/test_launch.py
@pytest.mark.slow
def test_two_process_checkpoint_resumes_in_one_process_on_another_layout(tmp_path):
    whole = train(
        config_lib.load(
            None,
            [*BASE, "parallel.tp=2", "run.steps=4", "run.checkpoint_every=-1", f"run.out_dir={tmp_path / 'whole'}"],
        )
    )
    out = tmp_path / "moved"
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "jaxdist.train.cli", "launch", "-n", "2", "--cpu-devices", "4", "--"]
    cmd += ["jaxdist", "train", *BASE, "run.steps=2", f"run.out_dir={out}"]  # ZeRO-1 over 2 x 4 devices
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(os.listdir(out / "checkpoints")) == ["2"]
    # both processes read it back (process 0 verifies the checksums for both), the run being finished
    again = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "unreadable" not in again.stderr
    rest = train(config_lib.load(None, [*BASE, "parallel.tp=2", "run.steps=4", f"run.out_dir={out}"]))
    assert len(rest) == 2
    np.testing.assert_allclose(rest, whole[2:], rtol=1e-5)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose([r["loss"] for r in rows], whole, rtol=1e-5)
