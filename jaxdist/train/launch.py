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
nothing waits forever; a worker that is stopped (SIGSTOP, process state T) when
another dies is named as the one that stopped making progress, since the others
fail waiting for it. SIGTERM or Ctrl-C to the launcher goes to every worker;
whatever still runs `grace_s` later is killed, and the launcher exits with
128 + the signal's number.
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


HEARTBEAT_ENV = "JAXDIST_HEARTBEAT_TIMEOUT_S"  # seconds without a heartbeat before a process counts as dead
GRACE_S = 30.0  # after a stop: how long workers get to save and exit before they are killed


def initialize_args(env: Mapping[str, str]) -> dict:
    """Keyword arguments for `jax.distributed.initialize` from the environment `jaxdist launch` sets
    (empty under SLURM / Open MPI, whose detection jax does itself, unless JAXDIST_COORDINATOR_BIND is set);
    $JAXDIST_HEARTBEAT_TIMEOUT_S sets how long a silent process is given before every process fails (jax: 100)."""
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
    if env.get(HEARTBEAT_ENV):
        args["heartbeat_timeout_seconds"] = int(env[HEARTBEAT_ENV])
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs, grace_s: float = 3.0, sig: int = signal.SIGTERM) -> None:
    """Send `sig` to the processes still running, then SIGKILL whatever outlives the grace period."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
            p.send_signal(signal.SIGCONT)  # a stopped process sees the signal only once it runs again
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def process_state(pid: int) -> str | None:
    """The one-letter state of process `pid` in /proc/PID/stat (R, S, D, T stopped, t traced, Z...), None if gone."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[0]  # the name, in parentheses, may hold spaces


def stopped_ranks(procs) -> list[int]:
    """The ranks whose process runs no more (stopped by a signal or a debugger) while it still exists."""
    return [rank for rank, p in enumerate(procs) if p.poll() is None and process_state(p.pid) in ("T", "t")]


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


def launch(cmd: list[str], n: int, *, cpu_devices: int | None = None, port: int = 0, grace_s: float = GRACE_S) -> int:
    """Run `cmd` as `n` processes; the exit status is 0 when all succeed, else the failure's (see the module)."""
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
    stop = _Signals(procs)  # before the first worker starts: a stop must never leave one behind
    for i in range(n):
        env = dict(os.environ, JAXDIST_COORDINATOR=address, JAXDIST_NUM_PROCESSES=str(n), JAXDIST_PROCESS_ID=str(i))
        env["JAXDIST_LOCAL_PROCESSES"] = str(n)  # they share this host's memory (jaxdist.train.memory)
        if shares[i] is not None:
            env["CUDA_VISIBLE_DEVICES"] = shares[i]
        if cpu_devices:
            flags = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
            env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={cpu_devices}"])
            env["JAX_PLATFORMS"] = "cpu"
            env["JAXDIST_CPU_COLLECTIVES"] = "gloo"
        try:
            # a process group of its own: a terminal's Ctrl-C reaches the launcher only, which passes it on once
            # (twice would be the trainer's "stop at once")
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, process_group=0)
        except OSError as e:
            _stop(procs)
            stop.close()
            print(f"jaxdist launch: cannot run {cmd[0]}: {e.strerror or e}", file=sys.stderr)
            return 127 if isinstance(e, FileNotFoundError) else 126
        procs.append(p)
        for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
            relays.append(threading.Thread(target=_relay, args=(stream, i, out, lock), daemon=True))
            relays[-1].start()
    try:
        code = _watch(procs, lock, stop)
        if code is None:  # the launcher was asked to stop: so are the workers
            with lock:
                print(
                    f"jaxdist launch: got {signal.Signals(stop.signum).name}; passing it to the workers "
                    f"(killed if still running in {grace_s:g} s)",
                    file=sys.stderr,
                    flush=True,
                )
            _stop(procs, grace_s, stop.signum)
            code = 128 + stop.signum
    finally:
        stop.close()
        _stop(procs)  # nothing outlives the launcher
    for t in relays:  # the last lines of every worker, before the launcher's own verdict
        t.join(timeout=5)
    return code


class _Signals:
    """SIGTERM and SIGINT to the launcher, recorded for the watch loop (main thread only); a second one
    kills the workers `procs` at once."""

    def __init__(self, procs: list):
        self.signum: int | None = None
        self.procs = procs
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._record)

    def _record(self, signum, frame) -> None:
        if self.signum is not None:  # a second one: no more grace
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
        self.signum = signum

    def close(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _watch(procs, lock: threading.Lock, stop: _Signals) -> int | None:
    """Wait for every worker; on the first failure name it (and a stopped rank it waited for), stop the rest,
    and return its code; None when the launcher got a stop signal first."""
    # the order the workers ended in: one that failed on its own ends first, and the others fail within
    # milliseconds (a collective's peer gone), often before the next poll: the first is the one to name
    ended, order = threading.Lock(), []

    def wait(rank, proc):
        code = proc.wait()
        with ended:
            order.append((rank, code))

    for rank, proc in enumerate(procs):
        threading.Thread(target=wait, args=(rank, proc), daemon=True).start()
    while stop.signum is None:
        with ended:
            failed = [(rank, c) for rank, c in order if c != 0]
        codes = [p.poll() for p in procs]
        if failed:
            rank, code = failed[0]
            stalled = stopped_ranks(procs)
            others = sum(c is None for i, c in enumerate(codes) if i != rank)
            with lock:
                if stalled:
                    names = ", ".join(f"rank {r} (pid {procs[r].pid})" for r in stalled)
                    print(
                        f"jaxdist launch: {names} stopped making progress: its process is stopped (state T, e.g. "
                        f"SIGSTOP or a debugger); rank {rank} then {_how(code)} waiting for it; stopping the other "
                        f"{others} running worker(s)",
                        file=sys.stderr,
                        flush=True,
                    )
                else:
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
    return None
