"""The learning-rate schedule against hand-computed values: linear warmup from 0, then cosine decay to
`lr * min_lr_ratio`; without warmup the first step trains at `lr` (it trained at 0: warmup_steps=0 was
taken as 1, wasting the step)."""

import math

import numpy as np
import pytest

from jaxdist.train.config import OptimConfig
from jaxdist.train.schedule import make_schedule


def cosine(lr, floor, t, n):
    return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * min(t, n) / n))


@pytest.mark.parametrize("warmup", [0, 1, 4])
def test_the_schedule_is_warmup_then_cosine_as_computed_by_hand(warmup):
    lr, ratio, steps = 0.3, 0.1, 20
    schedule = make_schedule(OptimConfig(lr=lr, warmup_steps=warmup, min_lr_ratio=ratio), steps)
    for count in range(steps + 2):  # optax's count: the step being trained is count + 1
        if count < warmup:
            want = lr * count / warmup
        else:
            want = cosine(lr, lr * ratio, count - warmup, steps - warmup)
        np.testing.assert_allclose(float(schedule(count)), want, rtol=1e-6, atol=1e-9)
    if warmup == 0:
        assert float(schedule(0)) == pytest.approx(lr)


def test_a_resume_that_changes_the_peak_warmup_or_floor_says_so(capsys):
    """Only optim.decay_steps was reported: a resume with another optim.lr (or a run.out_dir shared by
    two configs) jumped the learning rate silently (3e-4 to 1.8e-3 at the resume step)."""
    from jaxdist.train import config as config_lib
    from jaxdist.train.schedule import decay_steps

    saved = config_lib.load(None, ["optim.lr=3e-4", "run.steps=40"])
    meta = {"config": {"optim": {"lr": 3e-4, "warmup_steps": saved.optim.warmup_steps, "min_lr_ratio": 0.1}}}
    meta["config"]["run"] = {"steps": 40}
    assert decay_steps(config_lib.load(None, ["optim.lr=3e-4", "optim.min_lr_ratio=0.1"]), meta, 12) == 40
    assert "warning" not in capsys.readouterr().err
    changed = config_lib.load(None, ["optim.lr=1e-2", "optim.warmup_steps=7", "optim.min_lr_ratio=0.1"])
    assert decay_steps(changed, meta, 12) == 40
    err = capsys.readouterr().err
    assert "the learning-rate schedule changes from step 12 (optim.lr 0.0003 -> 0.01, optim.warmup_steps" in err
