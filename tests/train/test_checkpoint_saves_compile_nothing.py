"""A save in the training loop compiles nothing: the trainer converts the state for checkpoints once in
the first step's window, after that step (the stepped state is what the saves see), and makes the
first host copy there. On an H200 the first save of a GPT-124M run on one GPU had cost the loop 1.2 s:
the first copy into pinned host memory (1.16 s), and with the conversion warmed up on the initial
state instead of a stepped one, 0.15 s of converting again at the first save. The loop also runs with
its heap frozen after the first step (`jaxdist.train.heap`): a full garbage collection right after a save
had idled the GPU ~170 ms."""

import gc
import threading

import jax
from support.trainer_runs import tiny_run_config

from jaxdist.train import checkpoint, heap, trainer

LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # each program traced for a compile (cached or not)


def test_the_loops_saves_compile_nothing_after_the_warm_up(tmp_path, monkeypatch):
    calls, lowered, current = [], [], []  # current: the save-side call under way
    frozen = []  # the objects frozen out of the collector's passes, at each save

    def on_lowered(event, duration, **kwargs):
        if event == LOWERED and threading.current_thread() is threading.main_thread():
            lowered.append(current[-1] if current else None)

    def traced(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            if name != "freeze":
                frozen.append(gc.get_freeze_count())
            current.append(f"{name} {calls.count(name)}")
            try:
                return fn(*args, **kwargs)
            finally:
                current.pop()

        return call

    real_parallelize = trainer.parallelize

    def parallelize(*args, **kwargs):
        run = real_parallelize(*args, **kwargs)
        run.canonical = traced("canonical", run.canonical)
        step = run.step

        def stepped(*args, **kwargs):
            calls.append("step")  # only named: the step's compiles are the loop's, not the save side's
            return step(*args, **kwargs)

        stepped.compile = step.compile
        run.step = stepped
        return run

    monkeypatch.setattr(trainer, "parallelize", parallelize)
    monkeypatch.setattr(trainer, "_fetch_ahead", traced("fetch_ahead", trainer._fetch_ahead))
    monkeypatch.setattr(checkpoint.Checkpoints, "stage", traced("stage", checkpoint.Checkpoints.stage))
    monkeypatch.setattr(checkpoint.Checkpoints, "save", traced("save", checkpoint.Checkpoints.save))
    monkeypatch.setattr(checkpoint.Checkpoints, "warm_up", traced("warm_up", checkpoint.Checkpoints.warm_up))
    monkeypatch.setattr(heap.FrozenHeap, "freeze", traced("freeze", heap.FrozenHeap.freeze))
    gc.collect()
    before = gc.get_freeze_count()  # 0, or the ~375 immortal objects CPython 3.12 counts as frozen
    jax.monitoring.register_event_duration_secs_listener(on_lowered)
    try:  # the run of tests/support/trainer_runs.py's two_checkpoints: its programs are compiled once per test run
        trainer.train(tiny_run_config(tmp_path / "run", "run.steps=4", "run.checkpoint_every=2"))
    finally:
        jax.monitoring.unregister_event_duration_listener(on_lowered)
    # the warm-up converts the state after the first step; the saves at steps 2 and 4 convert it again,
    # each after starting the host reads of the values the loop reads next (the check, the log row: behind
    # the state's host copies they would wait for all of it), then stage its host copies, then save
    # the save in the loop (step 2) checks its state and starts writing only once step 3 is queued, so the
    # device runs a step meanwhile; the final save (step 4) has no next step. The heap is frozen after the
    # first step, again at the end of its iteration (its row's objects) and after the first save's start
    stage = ["fetch_ahead", "canonical", "stage"]
    first = ["step", "freeze", "canonical", "warm_up", "freeze"]
    assert calls == [*first, "step", *stage, "step", "save", "freeze", "step", *stage, "save"]
    assert None in lowered  # the run traced its programs (the step) ...
    assert set(lowered) <= {None, "canonical 1"}  # ... and on the save side only the warm-up's conversion
    # the canonical call before the warm-up comes right after the first step, which froze the heap (objects
    # frozen before the run, CPython 3.12's own, do not stop it); after the first save's write started,
    # the heap was frozen again, with what that save made; the loop's end released it all (a process that
    # trains again collects those objects as usual)
    assert all(n > before + 1000 for n in frozen), frozen
    gc.collect()
    assert gc.get_freeze_count() == before
