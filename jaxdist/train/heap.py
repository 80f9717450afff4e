"""The training loop's Python heap, kept out of the garbage collector's full passes.

A JAX process holds a few hundred thousand long-lived Python objects (the model, the compiled programs,
jax's and flax's caches). Python's full (generation 2) collection visits every one of them: 130-200 ms on
a CPU host, ~170 ms measured between two steps on a GPU host. The loop allocates steadily (flax's state
flattening, metrics, a checkpoint's writer), so such a pass comes every few dozen steps; right after a
sync (a log row, a checkpoint save) the device idles for all of it. After the first step the loop moves
every object alive then into the permanent generation (`gc.freeze`): later full passes visit only what the
run allocated since. The collector stays on, so the loop's own reference cycles are still freed.
"""

from __future__ import annotations

import gc


class FrozenHeap:
    """`freeze()` once the long-lived objects exist (after the first step); `release()` when the loop ends,
    so that a process that trains again (a test, a notebook) collects them as usual."""

    def __init__(self):
        self.frozen = False

    def freeze(self) -> None:
        if self.frozen or not gc.isenabled() or gc.get_freeze_count():
            return  # a caller who froze objects or switched the collector off manages the collector
        gc.collect()  # what is garbage already is freed, not frozen
        gc.freeze()
        self.frozen = True

    def release(self) -> None:
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
