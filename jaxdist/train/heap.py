"""The training loop's Python heap, kept out of the garbage collector's full passes.

A JAX process holds a few hundred thousand long-lived Python objects (the model, the compiled programs,
jax's and flax's caches). Python's full (generation 2) collection visits every one of them: 130-200 ms on
a CPU host, ~170 ms measured between two steps on a GPU host. The loop allocates steadily (flax's state
flattening, metrics, a checkpoint's writer), so such a pass comes every few dozen steps; right after a
sync (a log row, a checkpoint save) the device idles for all of it. After the first step the loop moves
every object alive then into the permanent generation (`gc.freeze`): later full passes visit only what the
run allocated since. The loop's first row, save and evaluation create long-lived objects of their own
(their small programs, orbax's handlers), so it freezes again after each. The collector stays on, so the
loop's own reference cycles are still freed.

Objects frozen before the loop (375 in the GPU test host's processes) do not stop it: deferring to them
left the whole heap in the full passes (on a CPU host, 30-100 ms each against 1-2 ms frozen, a dozen in
200 steps of a 12-layer model). At the loop's end everything frozen is given back to the collector, those
objects too (Python cannot unfreeze some objects only): freezing is an optimisation, and objects left
frozen across runs (a notebook that trains again) would keep the garbage among them, device buffers
included, for good.
"""

from __future__ import annotations

import gc


class FrozenHeap:
    """`freeze()` once the long-lived objects exist (after the first step), and again when more do;
    `release()` when the loop ends, so that a process that trains again (a test, a notebook) collects them
    as usual. A caller who switched the collector off manages it: neither does anything then."""

    def __init__(self):
        self.frozen = False

    def freeze(self) -> None:
        """Move every object alive now (what is garbage freed first) into the permanent generation."""
        if not gc.isenabled():
            return  # the caller switched the collector off: no full passes to keep anything out of
        gc.collect()  # what is garbage already is freed, not frozen
        gc.freeze()
        self.frozen = True

    def release(self) -> None:
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
