"""The training loop's heap (`jaxdist.train.heap`): frozen out of the collector's full passes (again when the
loop has made more long-lived objects), given back at the loop's end, and left alone where the caller
switched the collector off."""

import gc

from jaxdist.train.heap import FrozenHeap


def test_freeze_moves_the_live_objects_out_and_release_gives_them_back():
    before = gc.get_freeze_count()
    assert before == 0  # no test leaves objects frozen
    heap = FrozenHeap()
    heap.freeze()
    try:
        first = gc.get_freeze_count()
        assert first > 1000  # this process's modules, functions, jax's caches
        made_since = [[i] for i in range(5000)]  # long-lived objects the loop makes later (a save's, an evaluation's)
        heap.freeze()  # again: adds them (a margin: other threads may let go of a few frozen objects meanwhile)
        assert gc.get_freeze_count() > first + len(made_since) // 2
    finally:
        heap.release()
    assert gc.get_freeze_count() == before


def test_objects_frozen_before_the_loop_do_not_keep_its_heap_in_the_full_passes():
    gc.freeze()  # e.g. a library at import (375 objects in the GPU test host's processes)
    try:
        theirs = gc.get_freeze_count()
        made_since = [[i] for i in range(5000)]  # the loop's long-lived objects (the model, its programs)
        heap = FrozenHeap()
        heap.freeze()
        assert heap.frozen and gc.get_freeze_count() > theirs + len(made_since) // 2  # (the margin as above)
        heap.release()
        # everything back in the collector's care (Python cannot unfreeze some objects only)
        assert gc.get_freeze_count() == 0 and not heap.frozen
    finally:
        gc.unfreeze()


def test_a_caller_who_switched_the_collector_off_keeps_control():
    gc.disable()
    try:
        heap = FrozenHeap()
        heap.freeze()
        assert gc.get_freeze_count() == 0 and not heap.frozen
    finally:
        gc.enable()
