"""The nccl watchdog on real GPUs, two processes (multigpu: the lead runs them on 2 GPUs).

A rank that skips one all_reduce leaves its peer's last all_reduce without a partner:
both processes must end within the deadline + 10 s, with errors naming the op, its
sequence number and rank 1 as the missing rank. A run without a fault raises no alarm.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("watchdog_gpu_worker.py")
ROOT = WORKER.resolve().parents[2]
DEADLINE_S = 10.0
STEPS = 6


def _run_pair(tmp_path, skip: int, timeout_s: float):
    port = str(21000 + os.getpid() % 9000)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "JAXDIST_NCCL_TIMEOUT_S": str(DEADLINE_S),
        "JAXDIST_NCCL_EXIT_GRACE_S": "3",
        "JAXDIST_FLIGHT_RECORD_DIR": str(tmp_path),
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",  # the parent pytest may hold most of each GPU
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), port, str(STEPS), str(skip)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
            env={**env, "CUDA_VISIBLE_DEVICES": str(i)},
        )
        for i in range(2)
    ]
    t0 = time.monotonic()
    try:
        outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return procs, outs, time.monotonic() - t0


@pytest.mark.multigpu
def test_a_rank_that_skips_an_all_reduce_ends_both_processes_naming_op_sequence_and_missing_rank(tmp_path):
    procs, outs, elapsed = _run_pair(tmp_path, skip=2, timeout_s=DEADLINE_S + 120)
    last = f"all_reduce #{STEPS}"  # process 0's last all_reduce: process 1 issued one fewer
    for i, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode != 0, (i, out)
        assert "NcclTimeoutError" in out or "jaxdist nccl watchdog" in out, (i, out)
        assert last in out and "axis 'dp'" in out, (i, out)
        assert f"never issued by: rank 1 (process 1, last issued #{STEPS - 1})" in out, (i, out)
    assert "process 0 failed" in outs[1]
    (path,) = tmp_path.glob("jaxdist-flight-record-p0-pid*.json")
    (comm,) = json.loads(path.read_text())["communicators"]
    states = {o["seq"]: o["state"] for o in comm["ops"]}
    assert states[STEPS] == "started" and all(states[s] == "completed" for s in range(1, STEPS))
    # start-up (two jax processes, NCCL init) is inside `elapsed`, hence the generous bound;
    # the watchdog's own latency is checked on CPU (tests/comm/test_watchdog.py)
    assert elapsed < DEADLINE_S + 10 + 60, elapsed


@pytest.mark.multigpu
def test_a_run_without_a_fault_raises_no_alarm(tmp_path):
    procs, outs, _ = _run_pair(tmp_path, skip=-1, timeout_s=300)
    for i, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, (i, out)
        assert "CLEAN END" in out and "watchdog" not in out, (i, out)
        assert f"PROGRESS [[{STEPS}, {STEPS}]]" in out, (i, out)
    assert not list(tmp_path.glob("jaxdist-flight-record-*.json"))
