"""The run directory (`run.out_dir`): made writable, and either continued or started over on purpose.

A run directory holds one run: `metrics.jsonl`, `checkpoints/` and, with
TensorBoard, `tensorboard/`. An invocation either continues that run from a
checkpoint or, with `run.overwrite=true`, deletes it and starts over; starting
from step 0 next to an old run would mix the two (or silently replace its
checkpoints), so it is refused.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import jax

from jaxdist.train.config import ConfigError, RunConfig

RUN_FILES = ("metrics.jsonl", "curves.png")
RUN_DIRS = ("checkpoints", "checkpoints.unreadable", "tensorboard")


def _not_empty(path: Path) -> bool:
    return (path.is_file() and path.stat().st_size > 0) or (path.is_dir() and any(path.iterdir()))


def _why_not_resumable(run: RunConfig, out_dir: Path) -> str | None:
    """Why this invocation cannot continue the run in `out_dir` (None: there is none, or it can)."""
    has_checkpoints = _not_empty(out_dir / "checkpoints")
    if not (has_checkpoints or _not_empty(out_dir / "metrics.jsonl")):
        return None
    if not run.resume:
        return "run.resume=false"
    if not has_checkpoints:
        return "it has no checkpoint"
    if run.checkpoint_every < 0:
        return "run.checkpoint_every=-1 reads no checkpoints"
    return None


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
    elif why := _why_not_resumable(run, out_dir):
        raise ConfigError(
            f"run.out_dir {out_dir} already holds a run that this one cannot continue ({why}); "
            "set run.overwrite=true to delete it and start over, or pick a new run.out_dir"
        )
    return out_dir
