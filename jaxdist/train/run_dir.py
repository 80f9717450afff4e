"""The run directory (`run.out_dir`): made writable, and either continued or started over on purpose.

A run directory holds one run: `metrics.jsonl`, `checkpoints/` and, with
TensorBoard, `tensorboard/`. An invocation either continues that run from a
checkpoint or, with `run.overwrite=true`, deletes it and starts over; starting
from step 0 next to an old run would mix the two (or silently replace its
checkpoints), so it is refused.

One trainer at a time: process 0 holds an exclusive `flock` on `jaxdist.lock` in
the directory for the run's whole life, taken before anything in it is read or
changed. The kernel releases it when the process ends, however it ends, so a
lock left by a dead process never blocks the next run; the file names its
holder (pid, host, start time) for the error a second trainer stops with.
Readers (`jaxdist sample`, `export`, `plot`) take no lock: they change nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from jaxdist.train.config import ConfigError, RunConfig
from jaxdist.train.process_zero import on_process_zero
from jaxdist.train.report import warn

RUN_FILES = ("metrics.jsonl", "curves.png")
# what run.overwrite deletes; checkpoints.unreadable/ stays: what was set aside may be recovered, never deleted
RUN_DIRS = ("checkpoints", "tensorboard")
LOCK_FILE = "jaxdist.lock"  # never deleted: the lock is the flock on it, not its existence


def _not_empty(path: Path) -> bool:
    return (path.is_file() and path.stat().st_size > 0) or (path.is_dir() and any(path.iterdir()))


def _why_not_resumable(run: RunConfig, out_dir: Path) -> str | None:
    """Why this invocation cannot continue the run in `out_dir` (None: there is none, or it can)."""
    has_checkpoints = _not_empty(out_dir / "checkpoints")
    if not (has_checkpoints or _not_empty(out_dir / "metrics.jsonl")):
        return None
    if not run.resume:
        return "run.resume=false"
    if not has_checkpoints:
        return "it has no checkpoint"
    if run.checkpoint_every < 0:
        return "run.checkpoint_every=-1 reads no checkpoints"
    return None


class RunDirLock:
    """An exclusive `flock` on `directory/jaxdist.lock`, its holder's pid, host and start time written in it."""

    def __init__(self, directory: Path):
        self.path = directory / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise a one-line ConfigError naming the process that holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"run.out_dir {self.path.parent} is in use by another trainer ({self.holder()}); "
                "wait for it to finish or stop it, or pick another run.out_dir"
            ) from None
        except OSError as e:  # a file system without locks: refusing every run there would be worse
            os.close(fd)
            warn(f"run.out_dir {self.path.parent} cannot be locked ({e.strerror}); nothing stops a second trainer")
            return
        self.fd = fd
        started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started})
        data = (record + "\n").encode()
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))

    def holder(self) -> str:
        """Who holds the lock, as its file says ("an unknown process" while it is being written)."""
        try:
            record = json.loads(self.path.read_text())
            return f"pid {record['pid']} on host {record['host']}, started {record['started']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "an unknown process"

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases the flock
            self.fd = None


def _lock_on_process_0(out_dir: Path) -> RunDirLock | None:
    """Process 0's lock of `out_dir`; the other processes learn whether it got it (and stop with it if not)."""

    def lock() -> RunDirLock:
        held = RunDirLock(out_dir)
        held.acquire()
        return held

    return on_process_zero(lock, f"locking run.out_dir {out_dir}")


@contextlib.contextmanager
def prepared(run: RunConfig) -> Iterator[Path]:
    """`run.out_dir`, created and checked writable, locked by process 0 until the block ends, then cleared with
    `run.overwrite` (or refused when this invocation cannot continue the run in it)."""
    out_dir = _writable(run)
    lock = _lock_on_process_0(out_dir)
    try:
        _clear_or_check(run, out_dir)
        yield out_dir
    finally:
        if lock is not None:
            lock.release()


def _writable(run: RunConfig) -> Path:
    out_dir = Path(run.out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out_dir).close()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ConfigError(
            f"run.out_dir {out_dir} is not writable ({reason}); pick a directory you can write to"
        ) from None
    return out_dir


def _clear(out_dir: Path) -> None:
    for name in RUN_DIRS:
        shutil.rmtree(out_dir / name, ignore_errors=True)
    for name in RUN_FILES:
        (out_dir / name).unlink(missing_ok=True)


def _clear_or_check(run: RunConfig, out_dir: Path) -> None:
    """Delete the run in `out_dir` (run.overwrite), or refuse one this invocation cannot continue."""
    if run.overwrite:
        # nobody opens the run before process 0 has cleared it
        on_process_zero(lambda: _clear(out_dir), f"clearing run.out_dir {out_dir}")
    elif why := _why_not_resumable(run, out_dir):
        raise ConfigError(
            f"run.out_dir {out_dir} already holds a run that this one cannot continue ({why}); "
            "set run.overwrite=true to delete it and start over, or pick a new run.out_dir"
        )
