"""A second Ctrl-C interrupts at once, wherever the loop is. Landing in the host's work after a step
(staging a save, finishing it), it lost that step's metrics row for good (the handler saved the step,
the resume started after it), or started the same checkpoint twice and ended on a false save error.
Now the handler finishes what the interrupt cut, once: every row the run owes is there, once, and the
checkpoint of the last step is saved and intact."""

import pytest
from support.trainer_runs import rows, tiny_run_config

from jaxdist.train.checkpoint import Checkpoints
from jaxdist.train.trainer import train

SETTINGS = ("run.steps=6", "run.checkpoint_every=3", "run.eval_every=0")


def _interrupt_once(monkeypatch, method: str, after: bool):
    """Checkpoints.<method> raises KeyboardInterrupt at its first call (after doing its work, if `after`)."""
    original = getattr(Checkpoints, method)
    calls = []

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            return original(self, *args, **kwargs)
        if after:
            original(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Checkpoints, method, interrupted)


@pytest.mark.parametrize(
    "method, after", [("stage", False), ("save", False), ("save", True)], ids=["staging", "saving", "after-saving"]
)
def test_an_interrupt_in_a_saves_host_work_keeps_each_row_once_and_the_checkpoint(tmp_path, monkeypatch, method, after):
    out = tmp_path / "run"
    _interrupt_once(monkeypatch, method, after)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_run_config(out, *SETTINGS))
    saved = sorted(int(p.name) for p in (out / "checkpoints").iterdir())
    # staging (step 3's save, before its row was due): 3 saved by the handler; saving (done once step 4 is
    # queued): the save of 3 finished, then 4's state saved by the handler
    assert saved == ([3] if method == "stage" else [3, 4])
    assert [r["step"] for r in rows(out)] == list(range(1, saved[-1] + 1))
    monkeypatch.undo()
    train(tiny_run_config(out, *SETTINGS))  # resumes at 3: each step's row once
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4, 5, 6]
