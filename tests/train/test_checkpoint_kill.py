"""kill -9 during asynchronous saves, twice: the next run resumes from the newest complete checkpoint
and its losses continue exactly (metrics.jsonl equals an uninterrupted run's losses, bit for bit).
SIGTERM (a scheduler's stop) finishes the save in flight and saves the last finished step."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from jaxdist.train import config as config_lib
from jaxdist.train.trainer import train

REPO = Path(__file__).resolve().parents[2]
ARGS = [
    "model.flavor=tiny",
    "data.batch_size=16",
    "run.log_every=1",
    "run.progress=false",
    "optim.warmup_steps=2",
    "run.steps=10",
    # a 4-step schedule (then its final rate): the program of the other 4-step tiny runs (the schedule's
    # length is compiled in), compiled once per test run; the subprocesses read it from the shared cache
    "optim.decay_steps=4",
    "run.checkpoint_every=1",
    "run.keep_checkpoints=2",
]


def _saving(ckpts: Path) -> bool:
    """A save is in flight: orbax's temporary directory exists next to a complete checkpoint."""
    names = os.listdir(ckpts) if ckpts.is_dir() else []
    return any("tmp" in n for n in names) and any(n.isdigit() for n in names)


def _stop_during_a_save(out: Path, sig: int = signal.SIGKILL, deadline_s: float = 240) -> bool:
    """Start a run, send `sig` while a checkpoint is being written; True if caught mid-save."""
    cmd = [sys.executable, "-m", "jaxdist.train.cli", "train", *ARGS, f"run.out_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    start, mid_save = time.monotonic(), False
    try:
        while time.monotonic() - start < deadline_s and proc.poll() is None:
            if _saving(out / "checkpoints"):
                mid_save = True
                break
            time.sleep(0.005)
    finally:
        proc.send_signal(sig)
        proc.wait(timeout=120)
    return mid_save


def test_kill_9_during_saves_then_resume_continues_exactly(tmp_path):
    whole = train(config_lib.load(None, [*ARGS, "run.checkpoint_every=-1", f"run.out_dir={tmp_path / 'whole'}"]))
    out = tmp_path / "killed"
    caught = [_stop_during_a_save(out) for _ in range(2)]
    assert any(caught), "no save was in flight when the runs were killed"
    steps = sorted(int(n) for n in os.listdir(out / "checkpoints") if n.isdigit())
    assert steps, "no complete checkpoint survived"
    rest = train(config_lib.load(None, [*ARGS, f"run.out_dir={out}"]))  # resumes from the newest complete one
    assert 0 < len(rest) < 10  # resumed, not started over
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))
    np.testing.assert_array_equal([r["loss"] for r in rows], whole)


def test_sigterm_finishes_the_save_in_flight_and_saves_the_last_step(tmp_path):
    out = tmp_path / "stopped"
    _stop_during_a_save(out, signal.SIGTERM)
    names = os.listdir(out / "checkpoints")
    assert not [n for n in names if "tmp" in n], names  # nothing left half-written
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(int(n) for n in names) == rows[-1]["step"] < 10  # the last finished step, saved on the way out
