"""metrics.jsonl: every row strict JSON (non-finite values as null), each written in one write of a complete
line; a resume drops a cut-short last row (and skips a damaged one) with a one-line warning naming the file."""

import errno
import json
import os

import pytest

from jaxdist.train import config as config_lib
from jaxdist.train import metrics
from jaxdist.train.loop_output import MetricsLog
from jaxdist.train.trainer import train

RUN = ["model.flavor=tiny", "data.source=synthetic", "data.batch_size=8", "run.progress=false", "run.log_every=1"]


def _strict(line: str) -> dict:
    """A row as a strict JSON parser reads it (NaN and Infinity are not JSON)."""

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(line, parse_constant=refuse)


def test_non_finite_values_are_written_as_null_each_row_in_one_write(tmp_path, monkeypatch):
    writes = []
    real_write = os.write

    def recording_write(fd, data):
        writes.append(bytes(data))
        return real_write(fd, data)

    monkeypatch.setattr(metrics.os, "write", recording_write)
    log = MetricsLog(tmp_path, tensorboard=False)
    log.write({"step": 1, "loss": float("nan"), "lr": 1e-3, "grad_norm": float("inf"), "skipped": True})
    log.write({"step": 2, "loss": 2.5, "lr": float("-inf"), "tokens_per_s": 100.0})
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [_strict(line) for line in lines] == [
        {"step": 1, "loss": None, "lr": 1e-3, "grad_norm": None, "skipped": True},
        {"step": 2, "loss": 2.5, "lr": None, "tokens_per_s": 100.0},
    ]
    assert [w.decode() for w in writes] == [line + "\n" for line in lines]  # one write per complete row


def test_a_full_disk_while_logging_leaves_no_half_row_and_stops_on_one_line(tmp_path, monkeypatch):
    log = MetricsLog(tmp_path, tensorboard=False)
    log.write({"step": 1, "loss": 3.0})
    real_write = os.write

    def half_then_full(fd, data):
        return real_write(fd, data[: len(data) // 2])  # what fitted; the rest did not

    monkeypatch.setattr(metrics.os, "write", half_then_full)
    with pytest.raises(metrics.MetricsError, match=f"no space left on device \\({tmp_path}\\); free some space") as e:
        log.write({"step": 2, "loss": 2.0, "lr": 1e-3})
    assert "\n" not in str(e.value) and "metrics of step 2" in str(e.value)
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 3.0}\n'

    def disk_full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(metrics.os, "write", disk_full)
    log = MetricsLog(tmp_path, tensorboard=False, start=1)
    with pytest.raises(metrics.MetricsError, match="no space left on device"):
        log.write({"step": 2, "loss": 2.0})
    log.close()


def test_the_log_of_a_resumed_run_drops_a_cut_short_last_row_and_skips_a_damaged_one(tmp_path, capsys):
    """What the trainer's log does at a resume from step 2 (`MetricsLog(..., start=2)`), on the file a
    crash left: rows of later steps go (they are trained again), a damaged row is skipped and a cut-short
    last row dropped, each with a one-line warning naming the file."""
    path = tmp_path / "metrics.jsonl"
    good = ['{"step": 1, "loss": 5.5}', '{"step": 2, "loss": 5.3}']
    path.write_text(f'{good[0]}\n{{"step": 17, "lo\n{good[1]}\n{{"step": 3, "loss": 5.1, "lr": "0.00')
    log = MetricsLog(tmp_path, tensorboard=False, start=2)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert f"line 2 of {path} is not a metrics row" in err[0]
    assert f"the last row of {path} (line 4) is incomplete" in err[1] and "dropped" in err[1]
    log.write({"step": 3, "loss": 5.0})
    log.close()
    assert [_strict(line) for line in path.read_text().splitlines()] == [*map(_strict, good), {"step": 3, "loss": 5.0}]


# the whole loop: with the slow tests (the test above is what the trainer's log does at a resume)
@pytest.mark.slow
def test_a_resume_drops_a_cut_short_last_row_and_skips_a_damaged_one_with_a_warning(tmp_path, capsys):
    out = tmp_path / "run"
    over = [*RUN, f"run.out_dir={out}", "run.steps=3"]
    train(config_lib.load(None, over), stop_after=2)  # rows 1, 2 and a checkpoint of step 2
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text(f'{lines[0]}\n{{"step": 17, "lo\n{lines[1]}\n{{"step": 3, "loss": 5.1, "lr": "0.00')
    capsys.readouterr()
    assert len(train(config_lib.load(None, over))) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert f"line 2 of {path} is not a metrics row" in err[0]
    assert f"the last row of {path} (line 4) is incomplete" in err[1] and "dropped" in err[1]
    rows = [_strict(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[:2] == [_strict(lines[0]), _strict(lines[1])]
