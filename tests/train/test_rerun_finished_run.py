"""Running a finished run again with a smaller run.steps: the README says a run that already has its
steps reports it ("raise run.steps to train further"); it trains nothing, so it must save nothing.
It must not write the state of its newest step under the smaller step's name (a checkpoint whose
label and contents disagree, which retention may keep in place of a genuine one), nor fail on the
checkpoint of that step that already exists."""

import json
import os

import pytest
from support.trainer_runs import tiny_run_config as cfg

from jaxdist.train.trainer import train

EVERY = ["run.checkpoint_every=2", "run.keep_checkpoints=3"]


def test_a_smaller_run_steps_on_a_finished_run_saves_nothing(tmp_path):
    out = tmp_path / "run"
    train(cfg(out, "run.steps=4", *EVERY))
    assert sorted(os.listdir(out / "checkpoints"), key=int) == ["2", "4"]
    assert train(cfg(out, "run.steps=2", *EVERY)) == []  # step 2's checkpoint exists
    assert train(cfg(out, "run.steps=3", *EVERY)) == []  # no checkpoint of step 3
    assert sorted(os.listdir(out / "checkpoints"), key=int) == ["2", "4"]
    for step in ("2", "4"):
        assert json.loads((out / "checkpoints" / step / "meta" / "metadata").read_text())["step"] == int(step)


# with the slow tests: the fast run resumes bit for bit in tests/train/test_checkpoint_kill.py, and keeps the
# newest checkpoints in the test above
@pytest.mark.slow
def test_resuming_twice_with_one_checkpoint_kept_continues_exactly(tmp_path):
    """keep_checkpoints=1 and a save every step: each part leaves only its newest checkpoint, and the
    three parts' losses are the uninterrupted run's, bit for bit."""
    # 4 steps: the program of the test above (the schedule's length is compiled in), compiled once
    whole = train(cfg(tmp_path / "whole", "run.steps=4", "run.checkpoint_every=-1"))
    out, keep_one = tmp_path / "run", ["run.steps=4", "run.checkpoint_every=1", "run.keep_checkpoints=1"]
    parts = []
    for stop_after, newest in ((2, "2"), (1, "3"), (None, "4")):
        parts += train(cfg(out, *keep_one), stop_after=stop_after)
        assert os.listdir(out / "checkpoints") == [newest]
    assert parts == whole
