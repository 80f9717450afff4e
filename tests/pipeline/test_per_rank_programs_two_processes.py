"""Per-rank programs train as one device does: two processes, each holding one pp rank and tracing only
its own column of the table (`Pipelined(per_rank_programs=True)`), over 5 steps of every schedule (1F1B
with SGD, and with AdamW composed with tp; interleaved with recomputed activations; ZB-H1), against a
single-device optax run: losses, gradient norms and final parameters (tests/pipeline/per_rank_driver.py).
On the CPU the processes' collectives are gloo's; on two GPUs the pp sendrecvs are XLA's or jaxdist's
NCCL ops, one process per GPU. The trainer's whole loop with per-rank programs:
tests/train/test_multiprocess_loop_fsdp_tp_pipeline.py."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
DEADLINE_S = 420


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_processes(tmp_path: Path, platform: str, backend: str) -> dict:
    """Both processes' reports; a process that fails or passes the deadline fails the test with its output."""
    coordinator = f"127.0.0.1:{_free_port()}"
    procs, outs = [], []
    for process in (0, 1):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE.parents[1])]))
        env.pop("XLA_FLAGS", None)  # the driver sets its own device count
        if platform == "gpu":
            env["CUDA_VISIBLE_DEVICES"] = str(process)
            env["NCCL_NVLS_ENABLE"] = "0"
        out = tmp_path / f"process{process}.json"
        cmd = [sys.executable, str(HERE / "per_rank_driver.py"), str(process), coordinator, platform, backend, str(out)]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
            )
        )
        outs.append(out)
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=DEADLINE_S)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            pytest.fail(f"the two processes did not finish within {DEADLINE_S} s")
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log[-3000:]
    return {process: json.loads(out.read_text()) for process, out in enumerate(outs)}


def _check(reports: dict) -> None:
    for process, errors in reports.items():
        assert set(errors) == {"1f1b-m4-sgd", "1f1b-m8-adamw-tp", "interleaved-v2-m4-recompute-sgd", "zbh1-m4-adamw"}
        failed = {name: error for name, error in errors.items() if error is not None}
        assert not failed, f"process {process}: " + "\n".join(f"{k}: {v}" for k, v in failed.items())


@pytest.mark.slow  # two processes compile four schedules each: ~2 min on 2 shared cores
def test_two_cpu_processes_train_every_schedule_as_one_device(tmp_path):
    _check(run_two_processes(tmp_path, "cpu", "xla"))


@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["xla", "nccl"])
def test_two_gpu_processes_train_every_schedule_as_one_device(tmp_path, backend):
    _check(run_two_processes(tmp_path, "gpu", backend))
