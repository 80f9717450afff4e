"""Where a KeyboardInterrupt lands in the loop (a second Ctrl-C "stops at once"; CPython raises it at
the first bytecode after a long C++ call such as a compiling, donating step returns): the run stops
with KeyboardInterrupt, never with an unrelated error, and what it saves is labelled with the step the
state really holds. The reference is an uninterrupted run of the same config."""

import os

import numpy as np
import pytest
from support.trainer_runs import tiny_run_config

from jaxdist.train import trainer


def cfg(tmp_path, *overrides):
    return tiny_run_config(tmp_path / "run", *overrides)


STEPS = ["run.steps=4", "run.checkpoint_every=0"]  # no checkpoint before the end: the interrupt's save is the one


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return trainer.train(cfg(tmp_path_factory.mktemp("whole"), *STEPS))


class _LossReadInterrupted(dict):
    """Metrics whose loss, read right after the step returned, raises as a Ctrl-C arriving there would."""

    def __getitem__(self, key):
        if key == "loss":
            raise KeyboardInterrupt
        return super().__getitem__(key)


def _interrupting(monkeypatch, at_call: int, after_return: bool):
    real = trainer.parallelize

    def parallelize(*args, **kwargs):
        run = real(*args, **kwargs)
        step, calls = run.step, [0]

        def interrupted_step(state, batch):
            state, metrics = step(state, batch)  # dispatched: the input state is donated
            calls[0] += 1
            if calls[0] == at_call:
                if not after_return:
                    raise KeyboardInterrupt  # inside the step, after donation, before the loop has its result
                return state, _LossReadInterrupted(metrics)
            return state, metrics

        run.step = interrupted_step
        return run

    monkeypatch.setattr(trainer, "parallelize", parallelize)


def test_an_interrupt_inside_a_step_stops_cleanly_and_the_run_resumes(tmp_path, monkeypatch, whole):
    """Step 4 has taken the state of step 3 (donated) when the interrupt lands: nothing intact to save."""
    every_2 = ["run.steps=4", "run.checkpoint_every=2"]
    _interrupting(monkeypatch, at_call=4, after_return=False)
    with pytest.raises(KeyboardInterrupt):  # not "BlockHostUntilReady() called on deleted or donated buffer"
        trainer.train(cfg(tmp_path, *every_2))
    monkeypatch.undo()
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["2"]
    np.testing.assert_array_equal(trainer.train(cfg(tmp_path, *every_2)), whole[2:])


def test_an_interrupt_between_a_step_and_its_bookkeeping_saves_under_the_states_own_step(tmp_path, monkeypatch, whole):
    """The state already holds step 3 when the interrupt lands: its checkpoint must be step 3's."""
    _interrupting(monkeypatch, at_call=3, after_return=True)
    with pytest.raises(KeyboardInterrupt):
        trainer.train(cfg(tmp_path, *STEPS))
    monkeypatch.undo()
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["3"]
    rest = trainer.train(cfg(tmp_path, *STEPS))
    np.testing.assert_array_equal(rest, whole[3:])
