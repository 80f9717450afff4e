"""The trainer's whole loop across 2 processes x 4 CPU devices (gloo), for one strategy: validation
loss, checkpoint, a resume from it, the end-of-run sample, and `jaxdist sample` on the run afterwards.

The reference is an uninterrupted single-process run of the same layout on 8 devices: the training and
validation losses of the two-part, two-process run match it (rtol 1e-5: two processes reduce in another
order on CPU). Each launch has a deadline, so a hang fails the test instead of holding CI. The tests
(tests/train/test_multiprocess_loop_*.py) take minutes each, so they are spread over several files:
`pytest -n 2 --dist loadfile` runs them on both workers.
"""

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxdist.train import config as config_lib
from jaxdist.train.trainer import train
from support.trainer_runs import rows

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 420  # a launch takes ~1 min on 2 loaded cores; a hang takes forever
BASE = [
    # the README demo's model (jaxdist/train/configs/tiny.toml): with the 2-layer tiny flavor the old per-leaf
    # gather's programs were too short to overlap, so it seldom hung
    "model.flavor=small-cpu",
    "model.seq_len=64",
    "data.batch_size=16",
    "run.log_every=1",
    "run.progress=false",
    "optim.warmup_steps=2",
    "optim.decay_steps=4",  # the schedule of the whole run also for its first part
    "run.eval_every=1",  # every step gathers the parameters
    "run.eval_batches=2",
    "run.sample_prompt=The",
]
STRATEGIES = {
    "ddp-zero1": [],
    "fsdp": ["parallel.fsdp=8"],
    "hsdp": ["parallel.fsdp=4"],  # dp=2 x fsdp=4
    "dp-tp": ["parallel.tp=2"],
    "fsdp-tp": ["parallel.fsdp=2", "parallel.tp=2"],
    "pipeline": ["parallel.pp=2"],
    # each process one pp rank, tracing its own ticks; the one-process reference runs the one program
    "pipeline-per-rank": ["parallel.pp=2", "parallel.per_rank_programs=true"],
}
SAMPLE_TOKENS = 6


def launch(args: list[str], out: Path) -> subprocess.CompletedProcess:
    """`jaxdist launch -n 2 --cpu-devices 4 -- jaxdist train ARGS`, ended (its whole process group) at the deadline."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the launcher sets each worker's device count
    cmd = [sys.executable, "-m", "jaxdist.train.cli", "launch", "-n", "2", "--cpu-devices", "4", "--"]
    cmd += ["jaxdist", "train", *args, f"run.out_dir={out}"]
    proc = subprocess.Popen(
        cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        for pid in [*children(proc.pid), proc.pid]:  # the workers (each its own group) and the launcher
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the 2-process run did not finish within {DEADLINE_S} s:\n{stdout[-2000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(") ", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def check_two_processes_evaluate_checkpoint_resume_and_sample(tmp_path: Path, strategy: str) -> None:
    """Run `strategy` (a key of STRATEGIES) in two parts over 2 processes and check it against one process."""
    layout = STRATEGIES[strategy]
    ref_out = tmp_path / "reference"
    one_process = [k for k in layout if not k.startswith("parallel.per_rank_programs")]  # needs a process per rank
    train(
        config_lib.load(None, [*BASE, *one_process, "run.steps=4", "run.checkpoint_every=-1", f"run.out_dir={ref_out}"])
    )
    reference = rows(ref_out)
    out = tmp_path / "two-processes"
    sample = f"run.sample_tokens={SAMPLE_TOKENS}"

    first = launch([*BASE, *layout, "run.steps=2", sample], out)
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(os.listdir(out / "checkpoints")) == ["2"]
    assert "[rank 0] jaxdist: sample after 2 steps:" in first.stdout

    second = launch([*BASE, *layout, "run.steps=4", sample], out)  # resumes from step 2
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout
    assert "[rank 0] jaxdist: sample after 4 steps:" in second.stdout
    assert "jaxdist: sample after" not in "".join(line for line in second.stdout.splitlines() if "[rank 1]" in line)

    got = rows(out)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in reference], rtol=1e-5)
    evaluated = [(r["step"], r["val_loss"]) for r in got if "val_loss" in r]
    expected = [(r["step"], r["val_loss"]) for r in reference if "val_loss" in r]
    assert [s for s, _ in evaluated] == [s for s, _ in expected] == [1, 2, 3, 4]
    np.testing.assert_allclose([v for _, v in evaluated], [v for _, v in expected], rtol=1e-5)

    # the run's checkpoint, written by two processes, samples in one
    cmd = [sys.executable, "-m", "jaxdist.train.cli", "sample", str(out), "--prompt", "The", "--tokens", "5"]
    sampled = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=DEADLINE_S)
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    assert f"[{out}, step 4]" in sampled.stderr
    assert sampled.stdout.startswith("The")
