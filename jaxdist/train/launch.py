"""`jaxdist launch`: start N local processes of one command, wired with jax.distributed.

Each process gets JAXDIST_COORDINATOR (127.0.0.1 and a free port),
JAXDIST_NUM_PROCESSES and JAXDIST_PROCESS_ID, which the trainer passes to
`jax.distributed.initialize` (`initialize_args`). The coordination service has
no authentication, so it binds to the coordinator address itself (loopback for
a local launch), not to every interface as jax would; JAXDIST_COORDINATOR_BIND
overrides that for multi-node runs. Without GPUs each process simulates
`cpu_devices` CPU devices and uses JAX's gloo CPU collectives.

On a GPU machine each process gets its share of the visible GPUs (CUDA_VISIBLE_DEVICES).
Each worker's output lines come prefixed with its rank. If one worker dies, the
launcher says which and how, stops the others at once and exits non-zero, so
nothing waits forever.
"""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping

# gloo prints one line per peer connection when its context starts: noise at every launch
_GLOO_CONNECTED = re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks")


def initialize_args(env: Mapping[str, str]) -> dict:
    """Keyword arguments for `jax.distributed.initialize` from the environment `jaxdist launch` sets
    (empty under SLURM / Open MPI, whose detection jax does itself, unless JAXDIST_COORDINATOR_BIND is set)."""
    args = {}
    if env.get("JAXDIST_COORDINATOR"):
        args = {
            "coordinator_address": env["JAXDIST_COORDINATOR"],
            "num_processes": int(env["JAXDIST_NUM_PROCESSES"]),
            "process_id": int(env["JAXDIST_PROCESS_ID"]),
            # only the interface the workers connect to (jax's default is [::], every interface)
            "coordinator_bind_address": env["JAXDIST_COORDINATOR"],
        }
    if env.get("JAXDIST_COORDINATOR_BIND"):
        args["coordinator_bind_address"] = env["JAXDIST_COORDINATOR_BIND"]
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs, grace_s: float = 3.0) -> None:
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


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _relay(stream, rank: int, out, lock: threading.Lock) -> None:
    """Copy a worker's stream line by line, prefixed with its rank ('\\r' progress updates count as lines)."""
    for line in io.TextIOWrapper(stream, errors="replace"):
        if _GLOO_CONNECTED.match(line):
            continue
        with lock:
            out.write(f"[rank {rank}] {line if line.endswith(chr(10)) else line + chr(10)}")
            out.flush()


def visible_gpus(env: Mapping[str, str]) -> list[str]:
    """The GPUs this machine lets a process see: CUDA_VISIBLE_DEVICES, else what `nvidia-smi -L` lists."""
    if env.get("CUDA_VISIBLE_DEVICES") is not None:
        return [g for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def gpus_for_rank(gpus: list[str], n: int, rank: int) -> str | None:
    """Rank `rank`'s share of `gpus` as a CUDA_VISIBLE_DEVICES value (None without GPUs): each
    process owns its own GPUs, since NCCL forbids two ranks of one communicator on one GPU."""
    if not gpus:
        return None
    if len(gpus) % n:
        raise ValueError(f"{len(gpus)} GPUs do not split evenly over {n} processes; use -n dividing {len(gpus)}")
    k = len(gpus) // n
    return ",".join(gpus[rank * k : (rank + 1) * k])


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
    gpus = [] if cpu_devices else visible_gpus(os.environ)
    try:
        shares = [gpus_for_rank(gpus, n, i) for i in range(n)]
    except ValueError as e:
        print(f"jaxdist launch: {e}", file=sys.stderr)
        return 2
    procs, relays, lock = [], [], threading.Lock()
    for i in range(n):
        env = dict(os.environ, JAXDIST_COORDINATOR=address, JAXDIST_NUM_PROCESSES=str(n), JAXDIST_PROCESS_ID=str(i))
        if shares[i] is not None:
            env["CUDA_VISIBLE_DEVICES"] = shares[i]
        if cpu_devices:
            flags = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
            env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={cpu_devices}"])
            env["JAX_PLATFORMS"] = "cpu"
            env["JAXDIST_CPU_COLLECTIVES"] = "gloo"
        try:
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as e:
            _stop(procs)
            print(f"jaxdist launch: cannot run {cmd[0]}: {e.strerror or e}", file=sys.stderr)
            return 127 if isinstance(e, FileNotFoundError) else 126
        procs.append(p)
        for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
            relays.append(threading.Thread(target=_relay, args=(stream, i, out, lock), daemon=True))
            relays[-1].start()
    try:
        code = _watch(procs, lock)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        code = 130
    for t in relays:  # the last lines of every worker, before the launcher's own verdict
        t.join(timeout=5)
    return code


def _watch(procs, lock: threading.Lock) -> int:
    """Wait for every worker; on the first failure name it, stop the rest, and return its code."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            others = sum(c is None for c in codes)
            with lock:
                print(
                    f"jaxdist launch: rank {rank} {_how(code)}; stopping the other {others} running worker(s)",
                    file=sys.stderr,
                    flush=True,
                )
            _stop(procs)
            return code if code > 0 else 128 - code
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.1)
