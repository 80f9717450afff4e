"""A deadline per training step, kept on the host: hangs become errors on every backend.

The loop calls `beat(step)` as each step begins (or wraps a step in `with
guard.step(step):`). A thread fires when a step runs past `timeout_s`: it writes
the Python stack of every thread (faulthandler), the step and the last metrics
to `jaxdist-step-watchdog-p<process>-pid<pid>.txt` in `out_dir`, prints one
line naming the step and the file, and ends the process with status 3. Ending
the process is the only way out: the main thread is blocked where no exception
reaches it (a collective waiting for a peer that never comes), and each rank's
own guard fires, so no rank waits for another to notice.

The nccl backend has a finer watchdog of its own (jaxdist.comm.watchdog) that
names the op and the missing rank; this one covers the xla backend and
anything else a step can hang in (data loading, host callbacks).

`StopDeadline` ends the process `grace_s` after a SIGTERM or SIGINT unless it
ended by itself: the trainer stops at a step boundary on those signals, which a
rank stuck in a collective never reaches (its Python handler does not even run
while the main thread waits in XLA).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from jaxdist.comm import watchdog

EXIT_CODE = 3
TIMEOUT_ENV = "JAXDIST_STEP_TIMEOUT_S"
STOP_GRACE_ENV = "JAXDIST_STOP_GRACE_S"
STOP_GRACE_S = 20.0  # less than `jaxdist launch`'s grace, so a stuck worker says why before it is killed


class StepWatchdog:
    """Ends the process, with stacks on file, when one step takes longer than `timeout_s` (0: never)."""

    def __init__(
        self,
        timeout_s: float,
        out_dir: str | Path = ".",
        *,
        process_index: int = 0,
        exit_fn: Callable[[int], object] = os._exit,  # tests pass a recorder instead
    ):
        if timeout_s < 0:
            raise ValueError(f"step timeout must be >= 0 seconds (0 turns it off), got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.path = Path(out_dir) / f"jaxdist-step-watchdog-p{process_index}-pid{os.getpid()}.txt"
        self._cond = threading.Condition()
        self._step: int | None = None
        self._deadline: float | None = None
        self._metrics: dict = {}
        self._closed = False
        self._exit = exit_fn
        self._thread = None
        if self.timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="jaxdist-step-watchdog", daemon=True)
            self._thread.start()

    def beat(self, step: int) -> None:
        """Step `step` begins now: its deadline is `timeout_s` from here."""
        watchdog.set_step(step)  # the nccl flight recorder notes the step with every op
        with self._cond:
            self._step, self._deadline = step, time.monotonic() + self.timeout_s
            self._cond.notify()

    def pause(self) -> None:
        """No step runs now (e.g. between steps of a loop with long host work)."""
        with self._cond:
            self._deadline = None

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        self.beat(step)
        try:
            yield
        finally:
            self.pause()

    def record(self, metrics: dict) -> None:
        """The last metrics, for the report if a later step hangs."""
        with self._cond:
            self._metrics = dict(metrics)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def __enter__(self) -> StepWatchdog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                if self._deadline is None:
                    self._cond.wait()
                elif (left := self._deadline - time.monotonic()) > 0:
                    self._cond.wait(left)
                else:
                    self._deadline = None
                    self._fire(self._step, self._metrics)

    def _fire(self, step: int | None, metrics: dict) -> None:
        message = (
            f"jaxdist: step {step} did not finish within {self.timeout_s:g} s (run.step_timeout_s / "
            f"${TIMEOUT_ENV}); every thread's stack, the step and the last metrics are in {self.path}"
        )
        try:
            with open(self.path, "w") as f:
                f.write(f"{message}\nstep: {step}\nlast metrics: {json.dumps(metrics, default=str)}\n\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
        except OSError as e:
            message += f" (could not write it: {e})"
        print(message, file=sys.stderr, flush=True)
        self._exit(EXIT_CODE)


def timeout_from(configured: float) -> float:
    """The step deadline: $JAXDIST_STEP_TIMEOUT_S if set, else the configured one."""
    return float(os.environ.get(TIMEOUT_ENV) or configured)


class StopDeadline:
    """After SIGTERM or SIGINT (which need Python handlers installed: the trainer's), end the process with
    status 128 + the signal's number unless it ends first: `grace_s` later, or twice the longest a step
    has taken (`allow`), whichever is longer, so that a long step is not taken for a stuck one; `restart`
    (the caller reached its stop) starts the same period again for what follows (its save). Install in
    the main thread.

    Python's C-level handler writes each signal to the wakeup fd at once, also while the main thread is
    blocked in XLA; a thread reading it arms the deadline."""

    def __init__(self, grace_s: float, *, exit_fn: Callable[[int], object] = os._exit):
        if grace_s <= 0:
            raise ValueError(f"${STOP_GRACE_ENV} must be > 0 seconds, got {grace_s}")
        self.grace_s, self._exit = grace_s, exit_fn
        self._longest_step_s = 0.0
        self._armed_at = 0.0
        self._cond = threading.Condition()
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)  # a signal handler must never block
        self._previous = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        self._closed = False
        threading.Thread(target=self._watch, name="jaxdist-stop-deadline", daemon=True).start()

    def allow(self, step_s: float) -> None:
        """A step took `step_s` seconds: the deadline is at least twice the longest such."""
        with self._cond:
            self._longest_step_s = max(self._longest_step_s, step_s)
            self._cond.notify()

    def grace(self) -> float:
        return max(self.grace_s, 2 * self._longest_step_s)

    def _watch(self) -> None:
        while True:
            try:
                got = self._reader.recv(64)
            except OSError:
                return
            stops = [s for s in got if s in (signal.SIGINT, signal.SIGTERM)]
            if not got or self._closed:
                return
            if stops:
                break
        with self._cond:
            self._armed_at = time.monotonic()
            while not self._closed and (left := self._armed_at + self.grace() - time.monotonic()) > 0:
                self._cond.wait(left)
            if self._closed:  # the caller got past its stop: not stuck
                return
            waited = self.grace()
        name = signal.Signals(stops[0]).name
        print(
            f"jaxdist: still running {waited:g} s after {name} (stuck, e.g. in a collective waiting for "
            f"another process); ending the process (${STOP_GRACE_ENV} sets the grace period)",
            file=sys.stderr,
            flush=True,
        )
        self._exit(128 + stops[0])

    def restart(self) -> None:
        """The period starts again now (an armed deadline; one armed later starts then anyway)."""
        with self._cond:
            self._armed_at = time.monotonic()
            self._cond.notify()

    def close(self) -> None:
        """No more signals are watched, and a deadline armed is off."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        signal.set_wakeup_fd(self._previous)
        self._writer.close()


def stop_grace() -> float:
    """The grace period after a stop signal: $JAXDIST_STOP_GRACE_S if set, else 20 s."""
    return float(os.environ.get(STOP_GRACE_ENV) or STOP_GRACE_S)
