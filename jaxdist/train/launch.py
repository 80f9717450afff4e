"""`jaxdist launch`: start N local processes of one command, wired with jax.distributed.

Each process gets JAXDIST_COORDINATOR (localhost and a free port),
JAXDIST_NUM_PROCESSES and JAXDIST_PROCESS_ID, which the trainer passes to
`jax.distributed.initialize`. Without GPUs each process simulates
`cpu_devices` CPU devices and uses JAX's gloo CPU collectives. If one process
fails, the others are stopped, so nothing waits forever.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs, grace_s: float = 5.0) -> None:
    """SIGTERM the processes still running, then SIGKILL whatever outlives the grace period."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(cmd: list[str], n: int, *, cpu_devices: int | None = None, port: int = 0) -> int:
    if not cmd:
        print("jaxdist launch: give the command after --, e.g. jaxdist launch -n 2 -- jaxdist train", file=sys.stderr)
        return 2
    if n < 1:
        print(f"jaxdist launch: -n must be >= 1, got {n}", file=sys.stderr)
        return 2
    if cmd[0] == "jaxdist":  # the same interpreter and package as this launcher
        cmd = [sys.executable, "-m", "jaxdist.train.cli", *cmd[1:]]
    address = f"127.0.0.1:{port or _free_port()}"
    procs = []
    for i in range(n):
        env = dict(os.environ, JAXDIST_COORDINATOR=address, JAXDIST_NUM_PROCESSES=str(n), JAXDIST_PROCESS_ID=str(i))
        if cpu_devices:
            flags = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
            env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={cpu_devices}"])
            env["JAX_PLATFORMS"] = "cpu"
            env["JAXDIST_CPU_COLLECTIVES"] = "gloo"
        procs.append(subprocess.Popen(cmd, env=env))
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                _stop(procs)
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait(timeout=60)
        return 130
