"""The host-side step watchdog: a step past its deadline ends the process (status 3) with a
report naming the step, the last metrics and every thread's stack; a healthy loop never fires."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.trainer_runs import BASE

from jaxdist.train.step_watchdog import EXIT_CODE, StepWatchdog

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("step_watchdog_script.py")
DEADLINE_S = 3.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_healthy_loop_of_short_steps_never_fires(tmp_path):
    fired = []
    with StepWatchdog(0.5, tmp_path, exit_fn=fired.append) as guard:
        for step in range(4):
            with guard.step(step):
                time.sleep(0.05)
            time.sleep(0.6)  # between steps: paused, so longer than the deadline is fine
    assert fired == [] and not list(tmp_path.iterdir())


def test_a_slow_step_fires_once_with_the_step_and_last_metrics(tmp_path):
    fired = []
    with StepWatchdog(0.3, tmp_path, exit_fn=fired.append) as guard:
        guard.record({"loss": 1.5})
        with guard.step(4):
            time.sleep(1.0)
    assert fired == [EXIT_CODE]
    (report,) = tmp_path.iterdir()
    text = report.read_text()
    assert text.startswith("jaxdist: step 4 did not finish within 0.3 s") and '"loss": 1.5' in text
    assert "test_step_watchdog.py" in text  # the sleeping main thread's stack


def test_a_negative_deadline_is_refused():
    with pytest.raises(ValueError, match="step timeout must be >= 0"):
        StepWatchdog(-1)


def test_a_rank_stuck_in_a_step_ends_both_processes_naming_the_step(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
        "JAXDIST_COORDINATOR": f"127.0.0.1:{_free_port()}",
        "JAXDIST_NUM_PROCESSES": "2",
        "JAXDIST_CPU_COLLECTIVES": "gloo",
    }
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(DEADLINE_S), str(tmp_path)],
            env={**env, "JAXDIST_PROCESS_ID": str(i)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=DEADLINE_S + 90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    elapsed = time.monotonic() - t0
    for i, (p, (stdout, stderr)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == EXIT_CODE, (i, stdout, stderr)
        assert "step 3 done" not in stdout and "step 2 done" in stdout
        assert f"jaxdist: step 3 did not finish within {DEADLINE_S:g} s" in stderr
        (report,) = tmp_path.glob(f"jaxdist-step-watchdog-p{i}-pid*.txt")
        text = report.read_text()
        assert "step: 3" in text and '"loss": 2.0' in text and "Thread" in text
        # the stack of the stuck main thread points into the script's loop
        assert "step_watchdog_script.py" in text
    # both fire on their own clocks; the margin is process start-up (jax import, distributed init)
    assert elapsed < DEADLINE_S + 30


def test_the_trainer_ends_a_run_whose_step_passes_run_step_timeout_s(tmp_path):
    # the step is compiled before the loop (and the watchdog) starts, here from the test run's compilation
    # cache; step 0 then runs it and reads its loss back: tens of milliseconds at least (a warm tiny step on
    # 8 CPU devices takes ~60 ms, the first ~300 ms), far past 10 ms
    # support.trainer_runs' settings: the program of the other tiny runs of up to 3 steps
    cmd = [sys.executable, "-m", "jaxdist.train.cli", "train", *BASE, "run.steps=3", f"run.out_dir={tmp_path}"]
    done = subprocess.run(
        [*cmd, "run.step_timeout_s=0.01"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == EXIT_CODE, done.stderr[-2000:]
    assert "jaxdist: step 0 did not finish within 0.01 s" in done.stderr
    assert list(tmp_path.glob("jaxdist-step-watchdog-p0-pid*.txt"))
