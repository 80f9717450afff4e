"""The run directory (`run.out_dir`): made writable, and either continued or started over on purpose.

A run directory holds one run: `metrics.jsonl`, `checkpoints/` and, with
TensorBoard, `tensorboard/`. Starting a fresh run where one exists would mix
two runs (or silently replace checkpoints), so it needs `run.overwrite=true`,
which deletes the old run first.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import jax

from jaxdist.train.config import ConfigError, RunConfig

RUN_FILES = ("metrics.jsonl", "curves.png")
RUN_DIRS = ("checkpoints", "checkpoints.unreadable", "tensorboard")


def holds_run(out_dir: Path) -> bool:
    metrics = out_dir / "metrics.jsonl"
    checkpoints = out_dir / "checkpoints"
    return (metrics.is_file() and metrics.stat().st_size > 0) or (checkpoints.is_dir() and any(checkpoints.iterdir()))


def prepare(run: RunConfig) -> Path:
    """`run.out_dir`, created and checked writable; cleared first with `run.overwrite`."""
    out_dir = Path(run.out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out_dir).close()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ConfigError(
            f"run.out_dir {out_dir} is not writable ({reason}); pick a directory you can write to"
        ) from None
    if run.overwrite:
        if jax.process_index() == 0:
            for name in RUN_DIRS:
                shutil.rmtree(out_dir / name, ignore_errors=True)
            for name in RUN_FILES:
                (out_dir / name).unlink(missing_ok=True)
        if jax.process_count() > 1:  # nobody opens the run before process 0 has cleared it
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("jaxdist: run directory cleared")
    elif not run.resume and holds_run(out_dir):
        raise ConfigError(
            f"run.out_dir {out_dir} already holds a run and run.resume=false; set run.overwrite=true to delete it "
            "and start over, or pick a new run.out_dir"
        )
    return out_dir
