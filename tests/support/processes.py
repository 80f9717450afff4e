"""Processes of one jax.distributed job wired by hand, as SLURM or a script would (`jaxdist launch` would
stop the others as soon as one exits, hiding a hang), each on 1 CPU device."""

import os
import socket
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 120  # two processes start in ~10 s on a loaded CPU; the hangs these tests guard against took 300 s


def start_processes(cmd: list[str], tmp_path: Path, n: int = 2) -> list[tuple[subprocess.Popen, object]]:
    """`cmd` as processes 0..n-1 of one job, started: `(process, its log file)` each."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(n):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
        env.update(JAXDIST_COORDINATOR=f"127.0.0.1:{port}", JAXDIST_NUM_PROCESSES=str(n), JAXDIST_PROCESS_ID=str(rank))
        log = open(tmp_path / f"log{rank}.txt", "w+")  # noqa: SIM115 (read back by wait_all)
        procs.append((subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True), log))
    return procs


def wait_all(procs, cmd=None) -> list[subprocess.CompletedProcess]:
    """Wait for each of `procs` (from `start_processes`), killing all on a deadline or an error."""
    done = []
    try:
        for proc, log in procs:
            proc.wait(timeout=DEADLINE_S)
            log.seek(0)
            done.append(subprocess.CompletedProcess(cmd, proc.returncode, log.read()))
    finally:
        for proc, log in procs:
            proc.kill()
            log.close()
    return done


def two_processes(cmd: list[str], tmp_path: Path) -> list[subprocess.CompletedProcess]:
    """`cmd` as processes 0 and 1 of one job, both waited for."""
    return wait_all(start_processes(cmd, tmp_path), cmd)
