"""The training loop's heap (`jaxdist.train.heap`): frozen out of the collector's full passes once, given
back at the loop's end, and left alone where the caller manages the collector itself."""

import gc

from jaxdist.train.heap import FrozenHeap


def test_freeze_moves_the_live_objects_out_and_release_gives_them_back():
    before = gc.get_freeze_count()
    assert before == 0  # no test leaves objects frozen
    heap = FrozenHeap()
    heap.freeze()
    try:
        assert gc.get_freeze_count() > 1000  # this process's modules, functions, jax's caches
        heap.freeze()  # once only
    finally:
        heap.release()
    assert gc.get_freeze_count() == before


def test_a_caller_who_froze_objects_or_switched_the_collector_off_keeps_control():
    gc.freeze()
    try:
        theirs = gc.get_freeze_count()
        heap = FrozenHeap()
        heap.freeze()
        heap.release()
        # neither frozen again nor unfrozen by the loop's end (an unfreeze empties the permanent generation;
        # a frozen object another thread lets go of meanwhile leaves it, so the count may drop by a few)
        assert 0 < gc.get_freeze_count() <= theirs and not heap.frozen
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        heap = FrozenHeap()
        heap.freeze()
        assert gc.get_freeze_count() == 0 and not heap.frozen
    finally:
        gc.enable()
