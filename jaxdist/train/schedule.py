"""The learning-rate schedule (linear warmup, then cosine decay) and its length.

The length (`optim.decay_steps`) belongs to the run, not to one invocation: it
defaults to `run.steps` of the run's first invocation and is stored in every
checkpoint, so resuming with a larger `run.steps` extends the run without
changing the learning rate of any step. Changing `optim.decay_steps` (or the
peak, warmup or floor) on resume is allowed and reported: the schedule changes
from the resume step.
"""

from __future__ import annotations

import optax

from jaxdist.train.config import OptimConfig, TrainConfig
from jaxdist.train.report import warn


def make_schedule(o: OptimConfig, decay_steps: int) -> optax.Schedule:
    if o.warmup_steps == 0:  # no warmup: the first step trains at optim.lr (optax's warmup starts at 0)
        return optax.cosine_decay_schedule(init_value=o.lr, decay_steps=max(decay_steps, 1), alpha=o.min_lr_ratio)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=o.lr,
        warmup_steps=o.warmup_steps,
        decay_steps=max(decay_steps, o.warmup_steps + 1),
        end_value=o.lr * o.min_lr_ratio,
    )


def saved_decay_steps(meta: dict) -> int:
    """The schedule length a checkpoint was trained with (older checkpoints: their run.steps)."""
    return meta.get("schedule", {}).get("decay_steps") or meta["config"]["run"]["steps"]


def decay_steps(cfg: TrainConfig, resumed: dict | None, start: int) -> int:
    """The schedule length for this invocation, given the metadata of the checkpoint it resumes (if any)."""
    asked = cfg.optim.decay_steps
    if resumed is None:
        return asked or cfg.run.steps
    _report_changes(cfg.optim, resumed, start)
    saved = saved_decay_steps(resumed)
    if asked is None or asked == saved:
        return saved
    warn(f"optim.decay_steps changes from {saved} to {asked}: the learning-rate schedule changes from step {start}")
    return asked


SCHEDULE_KEYS = ("lr", "warmup_steps", "min_lr_ratio")  # the schedule's shape, besides its length


def _report_changes(o: OptimConfig, resumed: dict, start: int) -> None:
    """Warn of each schedule setting a resume changes (allowed: a run may lower its learning rate)."""
    saved = (resumed.get("config") or {}).get("optim") or {}
    changes = [
        f"optim.{k} {saved[k]:g} -> {getattr(o, k):g}"
        for k in SCHEDULE_KEYS
        if k in saved and saved[k] != getattr(o, k)
    ]
    if changes:
        warn(f"the learning-rate schedule changes from step {start} ({', '.join(changes)}) against the checkpoint's")
