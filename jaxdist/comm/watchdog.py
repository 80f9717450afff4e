"""Hangs become errors on the nccl backend: the flight recorder and the watchdog, seen from Python.

The C++ library numbers every op of each communicator and keeps its last records
in a ring (op, axis, dtype, count, peers, step, enqueue time, GPU state); its
watchdog thread trips when an op stays unfinished past the deadline: it writes
the records to a file, aborts every communicator and fails every later op.
This module adds what needs Python: the records as a dict (`flight_record`),
the exception in the main thread, and the ranks' view of each other through
`jax.distributed`'s key-value store (each process publishes how far it got, so
the error names the ranks that never issued the stuck op, and a failure on one
process trips the watchdog of every other). Without `jax.distributed` the local
half works alone.

Environment:
  JAXDIST_NCCL_TIMEOUT_S     the deadline (seconds) for an op to finish (300)
  JAXDIST_NCCL_WATCHDOG      0 turns the watchdog off (the recorder stays on)
  JAXDIST_FLIGHT_RECORDER    0 turns the flight recorder off (and so the watchdog)
  JAXDIST_FLIGHT_RECORD_DIR  where a failure writes jaxdist-flight-record-p<process>-pid<pid>.json (cwd)
  JAXDIST_FLIGHT_RECORD_SIZE records kept per communicator (2048)
  JAXDIST_NCCL_EXIT_GRACE_S  after a trip, how long the main thread has to take the exception
                             before the process exits with status 1 (10)
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time

from jaxdist.comm import native as _native

WATCHDOG_ENV = "JAXDIST_NCCL_WATCHDOG"
RECORDER_ENV = "JAXDIST_FLIGHT_RECORDER"
EXIT_GRACE_ENV = "JAXDIST_NCCL_EXIT_GRACE_S"
_KV_PREFIX = "jaxdist/watchdog"


class NcclTimeoutError(RuntimeError):
    """An NCCL op did not finish before the deadline (here or on another process)."""


_monitor: _Monitor | None = None


def _off(env: str) -> bool:
    return os.environ.get(env, "1").strip().lower() in ("0", "false", "no", "off")


def start(timeout_s: float) -> None:
    """Turn on the recorder and start the watchdog (the C++ thread and this module's monitor), once."""
    global _monitor
    lib = _native.ffi_library()
    recording = not _off(RECORDER_ENV)
    lib.jaxdist_flight_set_enabled(int(recording))
    lib.jaxdist_flight_set_process(_process_index())
    if _monitor is not None or not recording or _off(WATCHDOG_ENV):
        return
    lib.jaxdist_watchdog_start(int(_period_s(timeout_s) * 1000))
    _monitor = _Monitor(threading.main_thread().ident, _period_s(timeout_s))
    _monitor.start()


def stop() -> None:
    """Stop both threads (at exit, before the communicators are destroyed)."""
    global _monitor
    if _monitor is not None:
        _monitor.halt()
        _monitor.join()
        _native.ffi_library().jaxdist_watchdog_stop()


def agree_before_shutdown(timeout_s: float) -> None:
    """The end of a multi-process run: publish this process's final sequence numbers and wait
    (at most `timeout_s`) until every process has, or one reported a failure.

    Raises NcclTimeoutError when a peer failed (after aborting the communicators here, so
    none is finalized against a peer that will never come), when the ranks of a communicator
    issued different numbers of ops, or when a process never reached the end. Does nothing
    without jax.distributed, or once this process has failed (its error is already raised).
    """
    import jax

    client = _kv_client()
    if _monitor is None or client is None or _monitor.message:
        return
    _monitor.halt()
    _monitor.join()  # from here on this thread alone speaks for the process
    if failure():
        _monitor.deliver_here()
    me, n = _process_index(), jax.process_count()
    client.key_value_set(
        f"{_KV_PREFIX}/final/{me}", json.dumps(flight_record(ops=False)["communicators"]), allow_overwrite=True
    )
    deadline = time.monotonic() + timeout_s
    while True:
        _monitor.check_peers(client)
        if failure():
            _monitor.deliver_here()
        finals = {int(k.rsplit("/", 1)[-1]): json.loads(v) for k, v in client.key_value_dir_get(f"{_KV_PREFIX}/final/")}
        if len(finals) == n:
            break
        if time.monotonic() > deadline:
            missing = sorted(set(range(n)) - set(finals))
            why = f"jaxdist nccl watchdog: processes {missing} did not reach the end of the run in {timeout_s:.0f} s"
            _native.ffi_library().jaxdist_watchdog_trip(why.encode())
            _monitor.deliver_here()
        time.sleep(_monitor.period_s)
    issued_by: dict[int, dict[int, tuple[int, str, int]]] = {}  # communicator -> rank -> (process, axis, count)
    for p, comms in finals.items():
        for c in comms:
            issued_by.setdefault(c["key"], {})[c["rank"]] = (p, c["axis"], c["last_enqueued"])
    for ranks in issued_by.values():
        if len({last for _, _, last in ranks.values()}) > 1:
            axis = next(iter(ranks.values()))[1]
            issued = ", ".join(f"rank {r} (process {p}): {last}" for r, (p, _, last) in sorted(ranks.items()))
            why = f"jaxdist nccl: the ranks of axis '{axis}' issued different numbers of ops ({issued})"
            _native.ffi_library().jaxdist_watchdog_trip(why.encode())
            _monitor.deliver_here()


def exit_after_failure() -> None:
    """End a process whose watchdog tripped: status 1 at once, except process 0, which hosts the
    key-value store: it lingers two polling periods so the others can read its failure. (A process
    lingering after process 0 left would be aborted by jax's coordination client, SIGABRT.)"""
    message = (_monitor.message if _monitor is not None else "") or failure()
    # Said once more at the very end: the exception's own traceback may have been another one's.
    print(f"jaxdist: exiting with status 1: {message}", file=sys.stderr, flush=True)
    if _monitor is not None and _kv_client() is not None and _process_index() == 0:
        time.sleep(2 * _monitor.period_s + 0.5)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _period_s(timeout_s: float) -> float:
    """How often to look: often enough to fire within a small part of the deadline, at most once a second."""
    return min(1.0, max(0.05, timeout_s / 10))


def set_recorder(on: bool) -> None:
    """Turn the flight recorder on or off at run time (the benchmark measures its cost so)."""
    _native.ffi_library().jaxdist_flight_set_enabled(int(on))


def set_step(step: int) -> None:
    """The step the host is running: recorded with every op from now on (no-op before the backend loads)."""
    if _monitor is not None or _native.ffi_library.cache_info().currsize:
        _native.ffi_library().jaxdist_flight_set_step(int(step))


def flight_record(ops: bool = True) -> dict:
    """Every communicator's flight record: its last enqueued and completed sequence numbers
    and (with `ops`) its recorded ops, oldest first, each with its state now."""
    return json.loads(_native.read_string("jaxdist_flight_record", int(ops)))


def failure() -> str:
    """The watchdog's message, or "" while nothing tripped."""
    return _native.read_string("jaxdist_watchdog_failure")


def check() -> None:
    """Raise NcclTimeoutError if the watchdog tripped (here, or on another process)."""
    if _monitor is not None:
        _monitor.tick()
    if msg := failure():
        raise NcclTimeoutError(_monitor.message if _monitor and _monitor.message else msg)


# -- the ranks' view of each other -----------------------------------------------


def _process_index() -> int:
    import jax

    return jax.process_index()


def _kv_client():
    """jax.distributed's key-value store client, or None when it is not running."""
    try:
        from jax._src import distributed

        return distributed.global_state.client
    except Exception:  # noqa: BLE001  (an internal API: absent means no cross-rank view)
        return None


def _progress_of_all(client) -> dict[int, list[dict]]:
    """Every process's last published progress; a process that ended its run published its final one."""
    out = {}
    for kind in ("progress", "final"):
        for key, value in client.key_value_dir_get(f"{_KV_PREFIX}/{kind}/"):
            out[int(key.rsplit("/", 1)[-1])] = json.loads(value)
    return out


def missing_ranks(stuck: dict, progress: dict[int, list[dict]]) -> list[dict]:
    """Ranks of the stuck op's communicator that never issued it: their last enqueued
    sequence number is below the stuck one's."""
    return sorted(
        (
            {"process": p, "rank": c["rank"], "last_enqueued": c["last_enqueued"]}
            for p, comms in progress.items()
            for c in comms
            if c["key"] == stuck["key"] and c["last_enqueued"] < stuck["seq"]
        ),
        key=lambda r: r["rank"],
    )


def _describe_missing(stuck: dict | None, client) -> str:
    if stuck is None:
        return ""
    if client is None:
        return " (jax.distributed is not running, so which rank never came is unknown)"
    missing = missing_ranks(stuck, _progress_of_all(client))
    if not missing:
        return " (every rank issued it: look for the rank whose GPU work is stuck)"
    names = ", ".join(f"rank {m['rank']} (process {m['process']}, last issued #{m['last_enqueued']})" for m in missing)
    return f"; never issued by: {names}"


class _Monitor(threading.Thread):
    """Publishes this process's progress, turns a trip (local or a peer's) into an exception in the main thread."""

    def __init__(self, main_thread_id: int, period_s: float):
        super().__init__(name="jaxdist-nccl-watchdog", daemon=True)
        self.period_s = period_s
        self.main_thread_id = main_thread_id
        self.message = ""
        self.delivered = threading.Event()
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self._published = ""
        self._process = _process_index()

    def halt(self) -> None:
        self._halt.set()

    def run(self) -> None:
        while not self._halt.wait(self.period_s):
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001  (a broken key-value store must not kill the watchdog)
                print(f"jaxdist watchdog: {e}", file=sys.stderr)
            if self.message and not self.delivered.wait(_exit_grace_s()):
                # The main thread never ran Python again (blocked in native code that the abort
                # did not release): end the process rather than hang.
                print(f"jaxdist: {self.message}; exiting", file=sys.stderr, flush=True)
                os._exit(1)

    def tick(self) -> None:
        with self._lock:
            client = _kv_client()
            if self.message:
                return
            if msg := failure():
                self._fail(msg, client)
                return
            if client is None:
                return
            progress = json.dumps(flight_record(ops=False)["communicators"])
            if progress != self._published:
                client.key_value_set(f"{_KV_PREFIX}/progress/{self._process}", progress, allow_overwrite=True)
                self._published = progress
            if self.check_peers(client):
                self._fail(failure(), None)

    def check_peers(self, client) -> bool:
        """Trip the watchdog here if another process reported a failure."""
        for key, value in client.key_value_dir_get(f"{_KV_PREFIX}/failure/"):
            if int(key.rsplit("/", 1)[-1]) != self._process:
                why = f"jaxdist nccl watchdog: process {key.rsplit('/', 1)[-1]} failed: {value}"
                _native.ffi_library().jaxdist_watchdog_trip(why.encode())
                return True
        return False

    def _compose(self, msg: str, client) -> None:
        """The message with the missing ranks, published for the other processes."""
        self.message = msg + _describe_missing(flight_record(ops=False).get("stuck"), client)
        if client is not None and "failed: " not in msg:
            client.key_value_set(f"{_KV_PREFIX}/failure/{self._process}", self.message, allow_overwrite=True)

    def _fail(self, msg: str, client) -> None:
        self._compose(msg, client)
        _raise_in_thread(self.main_thread_id, self.message, self.delivered)

    def deliver_here(self) -> None:
        """Raise the failure in the calling thread (the monitor thread is stopped)."""
        if not self.message:
            self._compose(failure(), _kv_client())
        self.delivered.set()
        raise NcclTimeoutError(self.message)


def _exit_grace_s() -> float:
    return float(os.environ.get(EXIT_GRACE_ENV, "10"))


def _raise_in_thread(thread_id: int, message: str, delivered: threading.Event) -> None:
    """Raise NcclTimeoutError(message) in `thread_id` when it next runs Python code (it may be
    in block_until_ready until the aborted kernels return)."""

    def init(self, *args):
        NcclTimeoutError.__init__(self, message)
        delivered.set()

    cls = type("NcclTimeoutError", (NcclTimeoutError,), {"__init__": init, "__module__": __name__})
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(cls))
