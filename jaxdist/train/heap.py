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

Objects frozen before the loop do not stop it (CPython 3.12 counts ~375 of its own immortal objects as
frozen): deferring to them left the whole heap in the full passes (on a CPU host, 30-100 ms each against
1-2 ms frozen, a dozen in 200 steps of a 12-layer model). At the loop's end everything frozen is given
back to the collector (Python cannot unfreeze some objects only): objects left frozen across runs (a
notebook that trains again) would keep the garbage among them, device buffers included, for good. A
process that had frozen objects of its own before the loop (`gc.freeze`, e.g. before forking workers)
has its heap frozen again when `train` returns (`restore`): its objects stay frozen, with what else is
alive then (the loop's own objects are gone by then, collected first). After an exception they are left
in the collector's care: the traceback still holds the failed loop's objects, which a freeze would keep
for good.
"""

from __future__ import annotations

import gc


class FrozenHeap:
    """`freeze()` once the long-lived objects exist (after the first step), and again when more do;
    `release()` when the loop ends, so that a process that trains again (a test, a notebook) collects them
    as usual; `restore()` once the loop's objects are gone, which freezes the heap again where the caller
    had frozen objects before the loop. A caller who switched the collector off manages it: none of them
    does anything then."""

    def __init__(self):
        self.frozen = False
        self.before = 0  # objects frozen when this heap first froze (the caller's, an outer loop's, CPython's)

    def freeze(self) -> None:
        """Move every object alive now (what is garbage freed first) into the permanent generation."""
        if not gc.isenabled():
            return  # the caller switched the collector off: no full passes to keep anything out of
        if not self.frozen:
            self.before = max(self.before, gc.get_freeze_count())
        gc.collect()  # what is garbage already is freed, not frozen
        gc.freeze()
        self.frozen = True

    def release(self) -> None:
        if self.frozen:
            gc.unfreeze()
            self.frozen = False

    def restore(self) -> None:
        """After `release`, once the loop's objects are gone: if more objects were frozen before the loop than a
        full collection leaves frozen (CPython 3.12's own immortal objects count), freeze what is alive now,
        so that the caller's objects are frozen again (with the rest alive, as `gc.freeze` does)."""
        if self.before and not self.frozen and gc.isenabled():
            gc.collect()
            if gc.get_freeze_count() < self.before:
                gc.freeze()
        self.before = 0
