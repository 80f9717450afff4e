"""Where the training loop leaves the GPU idle: a `jax.profiler` trace of some steps of a `jaxdist train`
run (in this process), the compute stream's idle gaps, and what the loop's host side was doing in each.

    python bench/loop_timeline.py --flavor 124m --batch 16 --checkpoint-every 10      # a save every 10 steps
    python bench/loop_timeline.py --flavor 124m --batch 16 --checkpoint-every -1      # the same, no saves

The loop's own calls are marked in the trace (the step call, a save's `stage`, `save` and background
`_finish`, the NaN/Inf `check`, the row's learning rate, garbage collections of generations 1-2), so each
gap over `--gap-ms` is listed with the calls that overlap it, per thread (`main`, or the save's background
thread). Python's own tracer is off: it slows Python several times over and would make the host look
busier than it is. Printed: the traced span, the compute stream's busy and idle time in it, the idle per
`--window` steps (by the host's step calls), and the gaps. Needs a GPU (on a CPU it says so and stops).
"""

import argparse
import gc
import glob
import os
import shutil
import tempfile
import threading
from pathlib import Path

import jax
from jax.profiler import ProfileData, ProfileOptions, TraceAnnotation

from jaxdist.core import step as core_step
from jaxdist.train import checkpoint, config, loop_guards, step_watchdog, trainer

MARK = "loop:"


def mark(owner, name: str, label: str) -> None:
    """Wrap `owner.name` so that each call is a named span on its thread's line of the trace."""
    original = getattr(owner, name)

    def marked(*args, **kwargs):
        with TraceAnnotation(MARK + label):
            return original(*args, **kwargs)

    setattr(owner, name, marked)


def mark_collections() -> None:
    """Garbage collections of generation 1 or 2 as spans (the collector runs on the thread that allocates)."""
    open_spans = {}

    def on_collection(phase, info):
        if info["generation"] < 1:
            return
        key = threading.get_ident()
        if phase == "start":
            open_spans[key] = TraceAnnotation(f"{MARK}gc gen{info['generation']}")
            open_spans[key].__enter__()
        elif key in open_spans:
            open_spans.pop(key).__exit__(None, None, None)

    gc.callbacks.append(on_collection)


def trace_run(args, trace_dir: str) -> None:
    mark(core_step.PlacedStep, "__call__", "step")
    mark(checkpoint.Checkpoints, "stage", "stage")
    mark(checkpoint.Checkpoints, "save", "save")
    mark(checkpoint.Checkpoints, "_finish", "save in background")
    mark(loop_guards.NonFiniteSteps, "check", "check")
    mark(trainer, "_host_lr", "row's learning rate")
    mark_collections()
    beat = step_watchdog.StepWatchdog.beat
    options = ProfileOptions()
    options.python_tracer_level = 0

    def traced_beat(self, step):
        if step == args.trace_from:
            jax.profiler.start_trace(trace_dir, profiler_options=options)
        if step == args.trace_to:
            jax.profiler.stop_trace()
        with TraceAnnotation(f"{MARK}beat {step}"):
            return beat(self, step)

    step_watchdog.StepWatchdog.beat = traced_beat
    out = Path(tempfile.mkdtemp(dir=args.dir)) / "run"
    cfg = config.load(
        None,
        [
            f"model.flavor={args.flavor}",
            "model.dtype=bfloat16",
            "data.source=synthetic",
            f"data.batch_size={args.batch}",
            f"run.steps={args.trace_to + 5}",
            "run.log_every=10",
            f"run.checkpoint_every={args.checkpoint_every}",
            f"run.out_dir={out}",
            "run.progress=false",
            *args.set,
        ],
    )
    try:
        trainer.train(cfg)
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)


def report(trace_dir: str, args) -> None:
    data = ProfileData.from_file(sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1])
    gpus = sorted((p for p in data.planes if p.name.startswith("/device:GPU")), key=lambda p: p.name)
    if not gpus:
        print("no GPU in the trace: this benchmark measures a GPU's idle time")
        return
    compute = [line for line in gpus[0].lines if "Compute" in line.name][0]
    kernels = sorted((e.start_ns, e.start_ns + e.duration_ns) for e in compute.events)
    spans = []  # (start, end, label, thread)
    main_line = None
    for plane in data.planes:
        if not plane.name.startswith("/host"):
            continue
        for index, line in enumerate(plane.lines):  # lines are threads (their names are often empty)
            ours = [
                (e.start_ns, e.start_ns + e.duration_ns, e.name[len(MARK) :])
                for e in line.events
                if e.name.startswith(MARK)
            ]
            if any(n == "step" for _, _, n in ours):
                main_line = (plane.name, index)
            spans += [(a, b, n, (plane.name, index)) for a, b, n in ours]
    gaps, busy, end = [], 0, kernels[0][0]
    for a, b in kernels:
        if a > end:
            gaps.append((end, a))
        busy += max(0, b - max(a, end))
        end = max(end, b)
    t0, span = kernels[0][0], end - kernels[0][0]
    long = [(a, b) for a, b in gaps if b - a > args.gap_ms * 1e6]
    print(
        f"traced steps {args.trace_from}-{args.trace_to}: compute stream span {span / 1e6:.1f} ms, busy "
        f"{busy / 1e6:.1f} ms, idle {(span - busy) / 1e6:.1f} ms; {len(long)} gaps over {args.gap_ms} ms "
        f"({sum(b - a for a, b in long) / 1e6:.1f} ms)"
    )
    beats = sorted((a, int(n.split()[1])) for a, b, n, _ in spans if n.startswith("beat "))
    windows = [(a, s) for a, s in beats if s % args.window == 0]
    for (a, s), (b, s2) in zip(windows, windows[1:], strict=False):
        k = sum(max(0, min(y, b) - max(x, a)) for x, y in kernels)
        print(f"  host's steps {s}-{s2}: {(b - a) / 1e6:7.1f} ms, the compute stream idle {(b - a - k) / 1e6:6.1f} ms")
    for a, b in long:
        before = [s for t, s in beats if t <= a]
        over = sorted(
            {
                f"{n} ({'main' if line == main_line else 'background'})"
                for x, y, n, line in spans
                if x < b and y > a and not n.startswith("beat ")
            }
        )
        print(
            f"  gap at {(a - t0) / 1e6:8.1f} ms, {(b - a) / 1e6:6.1f} ms, after the host's step "
            f"{before[-1] if before else '-'}: {', '.join(over) or 'no marked call'}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="124m")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--checkpoint-every", type=int, default=10, help="-1: no checkpoints")
    p.add_argument("--trace-from", type=int, default=40, help="the step the trace starts at (after the compiles)")
    p.add_argument("--trace-to", type=int, default=80)
    p.add_argument("--gap-ms", type=float, default=1.0, help="list the compute stream's idle gaps over this")
    p.add_argument("--window", type=int, default=10, help="steps per line of the idle-time table")
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None, help="where the run writes")
    p.add_argument("--set", nargs="*", default=[], help="more config overrides, KEY=VALUE")
    args = p.parse_args()
    trace_dir = tempfile.mkdtemp()
    try:
        trace_run(args, trace_dir)
        report(trace_dir, args)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
