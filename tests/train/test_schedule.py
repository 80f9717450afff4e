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
