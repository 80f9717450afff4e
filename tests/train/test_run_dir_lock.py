"""One trainer per run directory: a second one stops on one line naming the first (before it reads or
changes anything there), a lock left by a dead process does not block the next run, and readers
(`jaxdist export`, `sample`) of a run change nothing in it."""

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxdist.models.gpt import GPT, GPTConfig
from jaxdist.train import config as config_lib
from jaxdist.train.checkpoint import Checkpoints
from jaxdist.train.cli import main
from jaxdist.train.config import ConfigError
from jaxdist.train.model_record import model_record
from jaxdist.train.trainer import train

REPO = Path(__file__).resolve().parents[2]
RUN = ["model.flavor=tiny", "data.source=synthetic", "data.batch_size=8", "run.progress=false"]
HOLD = """
import sys, time
from pathlib import Path
from jaxdist.train.run_dir import RunDirLock
lock = RunDirLock(Path(sys.argv[1]))
lock.acquire()
print("locked", flush=True)
time.sleep(600)
"""


def cfg(out_dir, *overrides):
    return config_lib.load(None, [*RUN, f"run.out_dir={out_dir}", *overrides])


@pytest.fixture
def holder(tmp_path):
    """A process holding the lock of tmp_path/run, as a running trainer does."""
    out = tmp_path / "run"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield out, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_a_second_trainer_stops_on_one_line_naming_the_running_one_and_changes_nothing(holder):
    out, proc = holder
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "keep-me").write_text("x")
    for overrides in [(), ("run.overwrite=true",), ("run.resume=false",)]:
        with pytest.raises(ConfigError, match=f"is in use by another trainer \\(pid {proc.pid} on host ") as e:
            train(cfg(out, "run.steps=1", *overrides))
        assert "\n" not in str(e.value)
        assert "started " in str(e.value)
    # nothing read or changed: not cleared by run.overwrite, no data prepared, no metrics rewritten
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "jaxdist.lock", "metrics.jsonl"]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["keep-me"]


def test_the_lock_of_a_dead_trainer_does_not_block_the_next_run_nor_a_finished_one(holder):
    out, proc = holder
    os.kill(proc.pid, signal.SIGKILL)  # dies holding it: the lock file stays behind
    proc.wait()
    assert (out / "jaxdist.lock").is_file()
    assert len(train(cfg(out, "run.steps=1"))) == 1
    assert len(train(cfg(out, "run.steps=2"))) == 1  # the finished run released it: resumes in this process


def _two_checkpoints(run_dir: Path, cfg: GPTConfig) -> Path:
    """Checkpoints of steps 1 and 2 (each step's parameters seeded by the step), as the trainer records them."""
    ckpt = Checkpoints(run_dir, keep=5)
    meta = {"model": model_record(dataclasses.asdict(cfg))}
    for step in (1, 2):
        ckpt.save(step, {"params": nnx.to_pure_dict(nnx.state(GPT(cfg, nnx.Rngs(step)), nnx.Param))}, meta)
    ckpt.close()
    return ckpt.directory


def test_readers_of_a_run_leave_an_unreadable_checkpoint_in_place(tmp_path, capfd):
    """The trainer of the run may be writing or deleting it: a reader never moves anything aside."""
    small = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=1)
    directory = _two_checkpoints(tmp_path / "run", small)
    data = max((p for p in (directory / "2").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    err = capfd.readouterr().err
    assert f"checkpoint {directory / '2'} is unreadable" in err and "left in place" in err
    from jaxdist.train.sample import load_run

    model, _, step = load_run(tmp_path / "run")
    assert step == 1
    expected = nnx.state(GPT(small, nnx.Rngs(1)), nnx.Param)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(model, nnx.Param), expected)
    after = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if "out" not in p.parts)
    assert after == before  # nothing moved, nothing deleted, no checkpoints.unreadable/
