"""One-line messages to the user, printed once per run (by process 0), and the words for a failed write."""

from __future__ import annotations

import errno
import sys
from pathlib import Path

import jax


def info(message: str) -> None:
    if jax.process_index() == 0:
        print(f"jaxdist: {message}", flush=True)


def warn(message: str) -> None:
    if jax.process_index() == 0:
        print(f"jaxdist: warning: {message}", file=sys.stderr, flush=True)


def is_terminal(stream) -> bool:
    """Whether progress bars may draw on `stream`: only a terminal shows carriage-return frames as one line
    (in a log file or a pipe, as under `jaxdist launch`, every frame would stay), so elsewhere plain lines."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def disk_full(e: BaseException) -> bool:
    """Whether `e` is a write that found the disk full: ENOSPC, or the text orbax and tensorstore give it
    (`RESOURCE_EXHAUSTED: ... No space left on device`)."""
    return getattr(e, "errno", None) == errno.ENOSPC or "no space left on device" in str(e).lower()


def write_problem(e: BaseException, path: str | Path) -> str:
    """Why a write into `path` failed, in a few words: "no space left on device (PATH)" for a full disk,
    else the first line of the error."""
    if disk_full(e):
        return f"no space left on device ({path})"
    return first_line(e)


def first_line(e: BaseException) -> str:
    """The first line of what `e` says (an OSError's reason without its number), at most 200 characters."""
    text = (e.strerror if isinstance(e, OSError) and e.strerror else str(e)) or type(e).__name__
    return text.strip().splitlines()[0][:200]
