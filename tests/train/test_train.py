"""The training stack: resume, restore onto another mesh, multi-process launch, config errors, plot."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.trainer_runs import BASE, tiny_run_config

from jaxdist.train.config import ConfigError
from jaxdist.train.trainer import train

REPO = Path(__file__).resolve().parents[2]


def cfg(tmp_path, *overrides, name="run"):
    return tiny_run_config(tmp_path / name, *overrides)


# ddp is slow: the default layout's resume is bit-exact in the fast run too (tests/train/test_checkpoint_kill.py)
@pytest.mark.parametrize(
    "parallel",
    [
        pytest.param("parallel.tp=1", id="ddp", marks=pytest.mark.slow),
        pytest.param("parallel.tp=2", id="engine-dp4xtp2"),
    ],
)
def test_resume_continues_with_the_same_losses(tmp_path, parallel):
    whole = train(cfg(tmp_path, parallel, "run.steps=6", "run.checkpoint_every=-1", name="whole"))
    first = train(cfg(tmp_path, parallel, "run.steps=6", name="split"), stop_after=3)  # stops and saves at step 3
    rest = train(cfg(tmp_path, parallel, "run.steps=6", name="split"))  # resumes from it
    assert len(first) == 3 and len(rest) == 3
    np.testing.assert_array_equal(first + rest, whole)
    assert len(set(whole)) == 6  # a real run: every step's loss differs
    assert train(cfg(tmp_path, parallel, "run.steps=6", name="split")) == []  # finished: running again is a no-op


# with the slow tests: the fast run resumes a run on another layout through the trainer in
# tests/train/data/test_data_stream_resume.py, and every layout's checkpoint converts in tests/core/test_canonical.py
@pytest.mark.slow
def test_restore_onto_another_mesh_gives_the_same_next_losses(tmp_path):
    # dp=4 x tp=2 over 6 steps: test_resume's program (the schedule's length is compiled in), compiled once
    tp_run = ["parallel.tp=2", "run.steps=6"]
    reference = train(cfg(tmp_path, *tp_run, "run.checkpoint_every=-1", name="ref"))
    train(cfg(tmp_path, *tp_run, name="moved"), stop_after=3)  # dp=4 x tp=2, saved at step 3
    moved = train(cfg(tmp_path, "parallel.tp=1", "parallel.fsdp=8", "run.steps=6", name="moved"))  # FSDP over 8
    assert len(moved) == 3
    np.testing.assert_allclose(moved, reference[3:], rtol=1e-5)


# two launched processes train as one in the fast run too: tests/train/test_checkpoint_multiprocess.py
# (ZeRO-1 over 2 x 4 devices, its losses those of one process under dp x tp)
@pytest.mark.slow
def test_two_processes_match_one_process_with_eight_devices(tmp_path):
    # 6 steps: the one-process run is the uninterrupted run of test_resume's dp4xtp2 case (compiled once)
    single = train(cfg(tmp_path, "parallel.tp=2", "run.steps=6", "run.checkpoint_every=-1", name="single"))
    out = tmp_path / "multi"
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "jaxdist.train.cli", "launch", "-n", "2", "--cpu-devices", "4", "--"]
    cmd += ["jaxdist", "train", *BASE, "parallel.tp=2", "run.steps=6", "run.checkpoint_every=-1", f"run.out_dir={out}"]
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose([r["loss"] for r in rows], single, rtol=1e-5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.layers=3"], "unknown config key 'model.layers'; valid keys in \\[model\\]: flavor, n_layers"),
        (["parallel.dp=3"], "does not multiply to the 8 devices; pick sizes whose product is 8"),
        (["data.batch_size=12"], "data.batch_size=12 is not divisible by the 8 data-parallel ranks"),
        (["run.steps=ten"], "run.steps must be an integer, got 'ten'"),
        (["model.flavor=huge"], "unknown model.flavor 'huge'"),
    ],
)
def test_bad_config_fails_with_a_one_line_error(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        train(cfg(tmp_path, *overrides))
    assert "\n" not in str(e.value)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    train(cfg(tmp_path, "run.steps=1", name="shared"))
    with pytest.raises(ConfigError, match="is for another model .*use a new run.out_dir"):
        train(cfg(tmp_path, "run.steps=2", "model.n_layers=3", name="shared"))


def test_cli_reports_errors_on_one_line_and_plots(tmp_path):
    cli = [sys.executable, "-m", "jaxdist.train.cli"]
    bad = subprocess.run([*cli, "train", "parallel.tpp=2"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "unknown config key 'parallel.tpp'" in bad.stderr
    run_dir = tmp_path / "plotted"
    train(cfg(tmp_path, "run.steps=3", "run.checkpoint_every=-1", name="plotted"))
    done = subprocess.run([*cli, "plot", str(run_dir)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
