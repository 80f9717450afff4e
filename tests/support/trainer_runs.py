"""The trainer's settings for quick whole-loop runs, and reading what a run wrote."""

import json
import os
from pathlib import Path

import pytest

from jaxdist.train import config as config_lib
from jaxdist.train.trainer import train

# the tiny flavor, logging every step; warm-up short enough that a 2-step run's second step learns
BASE = ["model.flavor=tiny", "data.batch_size=16", "run.log_every=1", "run.progress=false", "optim.warmup_steps=2"]


def tiny_run_config(out_dir, *overrides):
    """The config of a tiny run in `out_dir` (BASE, then `overrides`)."""
    return config_lib.load(None, [*BASE, f"run.out_dir={out_dir}", *overrides])


def rows(out_dir: Path) -> list[dict]:
    """The run's metrics.jsonl, one dict per row."""
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A 4-step run with checkpoints at steps 2 and 4, and its losses."""
    out = tmp_path_factory.mktemp("base") / "run"
    losses = train(tiny_run_config(out, "run.steps=4", "run.checkpoint_every=2"))
    assert sorted(os.listdir(out / "checkpoints"), key=int) == ["2", "4"]
    return out, losses


def largest_file(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def truncate_checkpoint(step_dir: Path) -> None:
    """Damage a checkpoint: its largest data file cut to half its size."""
    data = largest_file(step_dir)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
