"""The training loop's heap (`jaxdist.train.heap`): frozen out of the collector's full passes (again when the
loop has made more long-lived objects), given back at the loop's end, frozen again after it where the
caller had frozen objects of its own, and left alone where the caller switched the collector off."""

import gc

import pytest
from support.trainer_runs import tiny_run_config

from jaxdist.train import trainer
from jaxdist.train.heap import FrozenHeap


def frozen(obj) -> bool:
    """Whether the collector tracks `obj` but leaves it out of its generations: in the permanent one."""
    return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())


def collected_freeze_count() -> int:
    """The objects frozen after a full collection: 0, or the ~375 immortal objects CPython 3.12 counts."""
    gc.collect()
    return gc.get_freeze_count()


def test_freeze_moves_the_live_objects_out_and_release_gives_them_back():
    before = collected_freeze_count()
    assert before < 1000  # no test leaves objects frozen
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
    assert collected_freeze_count() == before


def test_objects_frozen_before_the_loop_do_not_keep_its_heap_in_the_full_passes():
    mine = [[1], [2]]
    gc.freeze()  # the caller's (e.g. before forking workers)
    try:
        theirs = gc.get_freeze_count()
        made_since = [[i] for i in range(5000)]  # the loop's long-lived objects (the model, its programs)
        heap = FrozenHeap()
        heap.freeze()
        assert heap.frozen and gc.get_freeze_count() > theirs + len(made_since) // 2  # (the margin as above)
        heap.release()
        # everything back in the collector's care while the loop's objects go (Python cannot unfreeze some
        # objects only) ...
        assert not heap.frozen and not frozen(mine)
        del made_since
        heap.restore()
        # ... then the caller's objects frozen again, with the rest alive (the garbage among them collected)
        assert frozen(mine) and gc.get_freeze_count() > theirs // 2
    finally:
        gc.unfreeze()


def test_without_objects_frozen_before_the_loop_nothing_stays_frozen():
    before = collected_freeze_count()
    mine = [[1], [2]]
    heap = FrozenHeap()
    heap.freeze()
    heap.release()
    heap.restore()
    assert not frozen(mine) and collected_freeze_count() == before


def test_an_inner_loop_leaves_the_outer_loops_heap_frozen():
    before = collected_freeze_count()
    outer, inner = FrozenHeap(), FrozenHeap()
    outer.freeze()
    try:
        inner.freeze()  # a loop run inside another (a callback that trains): the outer's objects are frozen
        inner.release()
        inner.restore()
        assert gc.get_freeze_count() > before + 1000  # the outer loop's heap is out of the full passes again
    finally:
        outer.release()
        outer.restore()
    assert collected_freeze_count() == before


def test_train_gives_a_callers_frozen_heap_back_frozen(tmp_path):
    """The trainer's loop unfreezes everything at its end; a process that froze its heap before `train` (e.g.
    before forking workers) finds it frozen again when `train` returns. The run is
    tests/support/trainer_runs.py's two_checkpoints (compiled once)."""
    mine = [[i] for i in range(20000)]
    gc.freeze()
    try:
        theirs = gc.get_freeze_count()
        assert theirs >= len(mine)
        trainer.train(tiny_run_config(tmp_path / "run", "run.steps=4", "run.checkpoint_every=2"))
        assert frozen(mine) and all(frozen(row) for row in mine[::1000])
        assert gc.get_freeze_count() > theirs // 2
    finally:
        gc.unfreeze()


def test_a_caller_who_switched_the_collector_off_keeps_control():
    before = collected_freeze_count()
    gc.disable()
    try:
        heap = FrozenHeap()
        heap.freeze()
        assert gc.get_freeze_count() == before and not heap.frozen
    finally:
        gc.enable()


# a trainer run: slow; the fast run gives a caller's frozen heap back through a whole train() above, and
# checks release and restore on their own
@pytest.mark.slow
def test_a_train_that_raises_freezes_nothing_of_its_own(tmp_path, monkeypatch):
    """After an exception the traceback still holds the failed loop's objects: `train` freezes nothing then
    (a freeze would keep their garbage for good), so the caller's objects are left unfrozen too."""
    before = collected_freeze_count()

    def fail(self):  # the end of the loop's first iteration, after it froze the heap
        raise RuntimeError("a step failed")

    monkeypatch.setattr(trainer.StopRequests, "check", fail)
    mine = [[i] for i in range(1000)]
    gc.freeze()
    try:
        with pytest.raises(RuntimeError, match="a step failed"):
            trainer.train(tiny_run_config(tmp_path / "run", "run.steps=4", "run.checkpoint_every=2"))
        assert not frozen(mine)
    finally:
        gc.unfreeze()
    assert collected_freeze_count() == before
