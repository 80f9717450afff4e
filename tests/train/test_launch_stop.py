"""Stopping `jaxdist launch`: a SIGTERM reaches every worker, whatever outlives the grace period is killed, and a
trainer stuck where its stop handler cannot act ends itself; a worker stopped by SIGSTOP is named as the rank
that stopped making progress, not the peer that failed waiting for it."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, "-m", "jaxdist.train.cli", "launch", "-n", "2"]
IGNORES_SIGTERM = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("pid", os.getpid(), flush=True)
time.sleep(300)
"""
# the trainer's stop handling installed, then the main thread blocked where no step boundary comes (as in a
# collective waiting for a peer): the handler runs, but the loop it asks to stop never gets there
STUCK_TRAINER = """
import os, threading
from jaxdist.train.loop_guards import StopRequests
stop = StopRequests()
print("pid", os.getpid(), flush=True)
lock = threading.Lock()
lock.acquire()
lock.acquire()
"""


def start(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def wait_for_lines(proc: subprocess.Popen, pattern: str, count: int, timeout_s: float) -> list[re.Match]:
    """The first `count` stdout lines of `proc` matching `pattern` (read line by line until the deadline)."""
    found, deadline = [], time.monotonic() + timeout_s
    while len(found) < count:
        if time.monotonic() > deadline or proc.poll() is not None:
            end(proc)
            pytest.fail(
                f"no {count} lines matching {pattern!r} in {timeout_s} s: {found}; {proc.stderr.read()[-3000:]}"
            )
        line = proc.stdout.readline()
        if m := re.search(pattern, line):
            found.append(m)
    return found


def end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")


def kill_if_alive(pids: list[int]) -> None:
    for pid in pids:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_sigterm_reaches_the_workers_and_those_ignoring_it_are_killed_after_the_grace_period():
    proc = start([*LAUNCH, "--grace", "2", "--", sys.executable, "-c", IGNORES_SIGTERM])
    pids = [int(m.group(1)) for m in wait_for_lines(proc, r"pid (\d+)", 2, 60)]
    try:
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM
        assert time.monotonic() - began < 15
        assert "jaxdist launch: got SIGTERM; passing it to the workers (killed if still running in 2 s)" in err
        assert all(gone(pid) for pid in pids)
    finally:
        end(proc)
        kill_if_alive(pids)


def test_a_trainer_stuck_where_its_stop_cannot_act_ends_itself_after_the_grace_period():
    env = dict(os.environ, JAXDIST_STOP_GRACE_S="1", PYTHONPATH=str(REPO))
    proc = start([*LAUNCH, "--grace", "120", "--", sys.executable, "-c", STUCK_TRAINER], env)
    pids = [int(m.group(1)) for m in wait_for_lines(proc, r"pid (\d+)", 2, 120)]
    try:
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - began < 30  # the workers ended themselves, long before the launcher's 120 s
        assert proc.returncode == 128 + signal.SIGTERM
        assert err.count("jaxdist: still running 1 s after SIGTERM") == 2, err[-3000:]
        assert all(gone(pid) for pid in pids)
    finally:
        end(proc)
        kill_if_alive(pids)


def worker_pids(launcher: int) -> dict[int, int]:
    """{rank: pid} of the workers `launcher` started (its children, by their JAXDIST_PROCESS_ID)."""
    ranks = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(") ", 1)[1].split()[1])
            if ppid == launcher:
                env = (stat.parent / "environ").read_bytes().split(b"\0")
                rank = next(int(v.split(b"=")[1]) for v in env if v.startswith(b"JAXDIST_PROCESS_ID="))
                ranks[rank] = int(stat.parent.name)
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return ranks


@pytest.mark.slow  # a 2-process training run: ~2 min on 2 shared cores, most of it starting up
def test_a_stopped_worker_is_named_as_the_rank_that_stopped_making_progress(tmp_path):
    env = dict(os.environ, JAXDIST_HEARTBEAT_TIMEOUT_S="10")  # jax's 100 s would make this test slow
    env.pop("XLA_FLAGS", None)
    train = ["jaxdist", "train", "model.flavor=tiny", "data.batch_size=16", "run.steps=100000", "run.log_every=1"]
    train += ["run.checkpoint_every=-1", "run.progress=false", f"run.out_dir={tmp_path / 'run'}"]
    proc = start([*LAUNCH, "--cpu-devices", "4", "--", *train], env)
    wait_for_lines(proc, r"^\[rank 0\] step 3 ", 1, 300)
    pids = worker_pids(proc.pid)
    try:
        assert sorted(pids) == [0, 1]
        os.kill(pids[1], signal.SIGSTOP)
        began = time.monotonic()
        _, err = proc.communicate(timeout=120)
        assert proc.returncode != 0
        verdict = [line for line in err.splitlines() if line.startswith("jaxdist launch:")]
        assert len(verdict) == 1, err[-3000:]
        assert verdict[0].startswith(f"jaxdist launch: rank 1 (pid {pids[1]}) stopped making progress"), verdict
        assert time.monotonic() - began < 90
        assert all(gone(pid) for pid in pids.values())  # the stopped one too
    finally:
        end(proc)
        kill_if_alive(list(pids.values()))
