"""A run over several invocations: the schedule survives resuming, starting over is explicit, a bad
checkpoint falls back to the previous one, a failed save stops on one line."""

import errno
import math
import os
import shutil

import numpy as np
import pytest
from support.trainer_runs import largest_file, rows, truncate_checkpoint
from support.trainer_runs import tiny_run_config as cfg
from support.trainer_runs import two_checkpoints as two_checkpoints  # the module's fixture

from jaxdist.train.checkpoint import CheckpointError
from jaxdist.train.config import ConfigError
from jaxdist.train.trainer import train

LR, MIN_RATIO, WARMUP = 3e-3, 0.1, 2  # the defaults and support.trainer_runs.BASE


def cosine_lr(step: int, decay_steps: int) -> float:
    """Linear warmup to LR over WARMUP steps, then cosine down to LR * MIN_RATIO at decay_steps."""
    if step < WARMUP:
        return LR * step / WARMUP
    frac = min(1.0, (step - WARMUP) / (decay_steps - WARMUP))
    end = LR * MIN_RATIO
    return end + (LR - end) * 0.5 * (1 + math.cos(math.pi * frac))


# three trainer runs (~25 s): slow; the fast run resumes onto the same schedule in tests/train/test_train.py
@pytest.mark.slow
def test_raising_run_steps_on_resume_keeps_the_schedule(tmp_path, capsys):
    # 4 steps: the program of the module's two_checkpoints run (the schedule is compiled in), compiled once
    out = tmp_path / "run"
    train(cfg(out, "run.steps=4"), stop_after=3)  # a 4-step schedule, saved at step 3
    train(cfg(out, "run.steps=8"), stop_after=1)  # extended: step 4 still on the 4-step schedule
    assert rows(out)[-1]["step"] == 4
    assert rows(out)[-1]["lr"] == pytest.approx(cosine_lr(3, decay_steps=4), rel=1e-6)
    assert cosine_lr(3, decay_steps=4) != pytest.approx(cosine_lr(3, decay_steps=8), rel=1e-3)  # it tells them apart
    assert "warning" not in capsys.readouterr().err
    # asking for another length is allowed, and said
    train(cfg(out, "run.steps=8", "optim.decay_steps=8"), stop_after=1)
    assert "optim.decay_steps changes from 4 to 8: the learning-rate schedule changes from step 4" in (
        capsys.readouterr().err
    )
    assert rows(out)[-1]["lr"] == pytest.approx(cosine_lr(4, decay_steps=8), rel=1e-6)
    assert cosine_lr(4, decay_steps=8) != pytest.approx(cosine_lr(4, decay_steps=4), rel=1e-3)


def test_starting_over_needs_overwrite_and_then_replaces_the_run(tmp_path, capsys):
    out = tmp_path / "run"
    train(cfg(out, "run.steps=2"))
    for fresh_start, why in [
        ("run.resume=false", "run.resume=false"),
        ("run.checkpoint_every=-1", "run.checkpoint_every=-1 reads no checkpoints"),
    ]:
        with pytest.raises(ConfigError, match=f"cannot continue \\({why}\\); set run.overwrite=true to delete it") as e:
            train(cfg(out, "run.steps=1", fresh_start))
        assert "\n" not in str(e.value)
    assert sorted(os.listdir(out / "checkpoints")) == ["2"]  # untouched
    capsys.readouterr()
    train(cfg(out, "run.steps=1", "run.resume=false", "run.overwrite=true"))
    assert [r["step"] for r in rows(out)] == [1]  # the old rows are gone, not appended to
    assert sorted(os.listdir(out / "checkpoints")) == ["1"]
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("jaxdist: done: step 1, final loss ")
    assert f"metrics in {out / 'metrics.jsonl'}, checkpoints in {out / 'checkpoints'}" in summary


def _flip(step_dir):
    data = largest_file(step_dir)
    raw = bytearray(data.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 16] = bytes(b ^ 0xFF for b in raw[middle : middle + 16])
    data.write_bytes(bytes(raw))


def _delete_item(step_dir):
    shutil.rmtree(step_dir / "meta")


# a deleted item is slow: the fast run falls back from a truncated and from a checksum-failing (flipped) newest
@pytest.mark.parametrize(
    "corrupt",
    [truncate_checkpoint, _flip, pytest.param(_delete_item, marks=pytest.mark.slow)],
    ids=["truncated", "flipped", "deleted"],
)
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(two_checkpoints, tmp_path, capsys, corrupt):
    base, losses = two_checkpoints
    out = tmp_path / "run"
    shutil.copytree(base, out)
    corrupt(out / "checkpoints" / "4")
    capsys.readouterr()
    rest = train(cfg(out, "run.steps=4", "run.checkpoint_every=2"))
    err = capsys.readouterr().err
    assert f"warning: checkpoint {out.absolute() / 'checkpoints' / '4'} is unreadable" in err
    assert err.count("\n") == 1  # one line, no traceback
    np.testing.assert_array_equal(rest, losses[2:])  # resumed from step 2: the same steps 3 and 4
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4]  # the rows of the lost steps are not repeated
    assert sorted(os.listdir(out / "checkpoints"), key=int) == ["2", "4"]  # step 4 saved again
    assert train(cfg(out, "run.steps=4", "run.checkpoint_every=2")) == []  # and it reads


def test_a_full_disk_during_a_save_stops_on_one_line_and_leaves_no_partial_checkpoint(tmp_path, monkeypatch, capfd):
    from orbax.checkpoint._src.handlers import json_checkpoint_handler

    async def disk_full(self, x, directory):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", disk_full)
    out = tmp_path / "run"
    with pytest.raises(CheckpointError, match="could not save the checkpoint of step 1: no space left on device") as e:
        train(cfg(out, "run.steps=1"))
    assert "\n" not in str(e.value)
    assert list((out / "checkpoints").iterdir()) == []  # the temporary directory is gone
    assert "Traceback" not in capfd.readouterr().err


def test_the_time_the_loop_waits_for_checkpoint_saves_is_logged_and_summed(tmp_path, monkeypatch, capsys):
    """A save waits for the one in flight: the window that does says how long (`checkpoint_s`), and the
    end-of-run line says what share of the time went there when it is more than 5%."""
    import time

    from jaxdist.train import checkpoint

    real = checkpoint.Checkpoints._write_checksums

    def slow_checksums(self, step):  # a slow disk: each save finishes 1.5 s after orbax's writes
        time.sleep(1.5)
        real(self, step)

    monkeypatch.setattr(checkpoint.Checkpoints, "_write_checksums", slow_checksums)
    out = tmp_path / "run"
    train(cfg(out, "run.steps=3", "run.checkpoint_every=1"))
    waits = [r["checkpoint_s"] for r in rows(out)]
    # each save is in its own step's row (it comes before the row's wait for the step)
    assert waits[0] < 0.75  # save 1: none in flight to wait for
    assert waits[1] >= 0.75  # save 2 waited for save 1's last 1.5 s, less step 2 (fast: compiled already)
    assert waits[2] == 0.0  # the last step's save comes after the loop
    assert "waiting for checkpoint saves" in capsys.readouterr().out  # info() prints to stdout
    train(cfg(tmp_path / "none", "run.steps=2", "run.checkpoint_every=-1"))
    assert all("checkpoint_s" not in r for r in rows(tmp_path / "none"))  # not computed: left out
