"""Work that process 0 does for every process, whose failure every process learns of.

A barrier after process 0's part (preparing the data, clearing the run directory) leaves the other
processes waiting there when that part raises: process 0 exits, and under a launcher other than
`jaxdist launch` (SLURM, a hand-written script) every process then hangs in jax's shutdown barrier
for its whole timeout (5 minutes), the others never saying why. `on_process_zero` replaces the barrier
with one broadcast of the outcome: every process raises at once, naming process 0's error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax
import numpy as np

from jaxdist.train.report import first_line

T = TypeVar("T")

MESSAGE_BYTES = 1024  # process 0's message, as far as the others see it


class ProcessZeroError(RuntimeError):
    """What the other processes raise when process 0's part failed; the message is one line."""


def on_process_zero(work: Callable[[], T], what: str) -> T | None:
    """Run `work` on process 0 alone and return its result there (None on the others), once every process
    knows it is done. If it raised, process 0 re-raises its exception and the others raise
    ProcessZeroError("process 0 failed <what>: <the first line of its message>"). With one process this
    is `work()`."""
    if jax.process_count() == 1:
        return work()
    from jax.experimental import multihost_utils

    result, error = None, None
    if jax.process_index() == 0:
        try:
            result = work()
        except Exception as e:  # every process must reach the broadcast, whatever went wrong
            error = e
    message = np.zeros(MESSAGE_BYTES, np.uint8)
    if error is not None:
        text = first_line(error).encode()[: MESSAGE_BYTES - 1]
        message[: len(text)] = np.frombuffer(text, np.uint8)
        message[-1] = 1  # the flag: process 0 failed (its message may be empty)
    shared = np.asarray(multihost_utils.broadcast_one_to_all(message))
    if error is not None:
        raise error
    if shared[-1]:
        said = bytes(shared[:-1]).rstrip(b"\0").decode(errors="replace")
        raise ProcessZeroError(f"process 0 failed {what}: {said}")
    return result
