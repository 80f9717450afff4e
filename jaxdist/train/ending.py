"""How a process of a multi-process run ends after an error, so that no process waits for the others.

A normal exit runs jax's shutdown barrier, which waits for every process (5 minutes). After an
error one process found alone (a data path missing on one node) the others are blocked in a
collective for it and never come: both would wait out the barrier, then abort, and `jaxdist
launch` would name whichever rank aborted first. So a process that stops on an error ends at once
(`os._exit`), after saying so in jax's key-value store. Process 0 hosts the coordination service,
whose end aborts every other process within milliseconds: it first waits (at most `PEERS_S`) until
the others have said they end too, so that an error every process raises together (a bad checkpoint,
process 0's failed work) is printed by each of them before any is aborted.
"""

from __future__ import annotations

import os
import sys
import time

PEERS_S = 10.0  # how long process 0 waits for the others to end (they are blocked if it failed alone)
# after the others have said so: a process between saying it ends and ending is still aborted by the
# service's end (seen under load: status -6 for a process that had said 2)
GRACE_S = 1.0


def _distributed():
    """jax.distributed's state when a multi-process run is up, else None (read without touching the
    backend: the error being handled may be the backend's own failure to start)."""
    if "jax" not in sys.modules:
        return None
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover (an internal module: without it, the normal exit)
        return None
    state = distributed.global_state
    if getattr(state, "client", None) is None or (getattr(state, "num_processes", None) or 1) <= 1:
        return None
    return state if isinstance(getattr(state, "process_id", None), int) else None


def in_multi_process_run() -> bool:
    return _distributed() is not None


def end_after_error(code: int) -> int:
    """`code` in a single-process run; in a multi-process run the process ends here with it."""
    state = _distributed()
    if state is None:
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    rank, client = state.process_id, state.client
    try:
        client.key_value_set(f"jaxdist/ended/{rank}", str(code))
        if rank == 0:
            deadline = time.monotonic() + PEERS_S
            for peer in range(1, state.num_processes):
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0:
                    break
                client.blocking_key_value_get(f"jaxdist/ended/{peer}", left_ms)
            time.sleep(max(0.0, min(GRACE_S, deadline - time.monotonic())))
    except Exception:  # noqa: BLE001  (a peer that never says so, or a service already gone: end anyway)
        pass
    os._exit(code)
