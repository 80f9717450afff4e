"""Where a step's GPU time goes: a `jax.profiler` trace summarized per op and per kind of op.

`summarize(trace_dir, steps)` reads the `.xplane.pb` a `jax.profiler.trace` wrote and returns,
for the first GPU, the busy time per step of each kind of op (matrix multiplies, attention,
collectives by kind, fusions, copies) and the most expensive single ops, from the
device's "XLA Ops" line (one event per executed HLO op). Time on a communication stream that
overlaps compute is counted in its own kind, so kinds may add up to more than the step.
"""

from __future__ import annotations

import collections
import glob
import re

KINDS = (  # first match wins: (kind, pattern on the op name: XLA's HLO names or NCCL's kernel names)
    ("all-gather", r"all-gather|AllGather"),
    ("all-reduce", r"all-reduce|AllReduce"),
    ("reduce-scatter", r"reduce-scatter|ReduceScatter"),
    ("send/recv, permute", r"collective-permute|SendRecv|ncclDevKernel_(Send|Recv)"),
    ("all-to-all", r"all-to-all|AllToAll"),
    ("other nccl / jaxdist ffi", r"jaxdist|nccl"),
    ("attention (cudnn)", r"cudnn|fmha|flash"),
    ("matmul", r"gemm|cublas|nvjet|dot|matmul"),
    ("copy / transpose", r"^copy|transpose|dynamic-update-slice|dynamic-slice|concatenate|Memcpy"),
    ("fusion", r"fusion|loop_|input_"),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def summarize(trace_dir: str, steps: int, top: int = 25) -> str:
    from jax.profiler import ProfileData

    paths = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))
    if not paths:
        return f"no trace under {trace_dir}"
    data = ProfileData.from_file(paths[-1])
    gpus = [p for p in data.planes if p.name.startswith("/device:GPU")]
    if not gpus:
        return "no GPU plane in the trace: " + ", ".join(p.name for p in data.planes)
    plane = sorted(gpus, key=lambda p: p.name)[0]
    lines = {line.name: line for line in plane.lines}
    per_op: dict[str, list[float]] = collections.defaultdict(list)
    source = "XLA Ops" if "XLA Ops" in lines else None
    for name, line in lines.items():
        if source and name != source:
            continue
        for event in line.events:
            per_op[event.name].append(event.duration_ns / 1e3)
    out = [f"{plane.name}, line {source or 'all streams'}: {', '.join(lines)}"]
    by_kind: dict[str, float] = collections.defaultdict(float)
    for name, durations in per_op.items():
        by_kind[kind_of(name)] += sum(durations)
    total = sum(by_kind.values())
    out.append(f"busy per step {total / steps / 1e3:.2f} ms (sum of op durations / {steps} steps)")
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        out.append(f"  {kind:22s} {us / steps / 1e3:8.2f} ms/step  {100 * us / total:5.1f}%")
    out.append(f"top {top} ops (ms/step, calls/step):")
    ranked = sorted(per_op.items(), key=lambda kv: -sum(kv[1]))[:top]
    for name, durations in ranked:
        out.append(f"  {sum(durations) / steps / 1e3:8.3f}  {len(durations) / steps:6.1f}  {name[:110]}")
    for name, line in lines.items():  # stream occupancy: is communication overlapped?
        if name.startswith("Stream"):
            busy = sum(e.duration_ns for e in line.events) / 1e6 / steps
            out.append(f"  stream {name[:60]}: busy {busy:.2f} ms/step")
    out.append(idle_time(lines.values(), steps))
    return "\n".join(out)


def idle_time(lines, steps: int) -> str:
    """The traced steps' span on the device, the part of it no kernel ran (the union of every stream's
    kernels: what launch gaps and waits for the host cost), and the gaps over 50 us."""
    spans = sorted((e.start_ns, e.end_ns) for line in lines if line.name.startswith("Stream") for e in line.events)
    if not spans:
        return "  no stream events: idle time unknown"
    busy, gaps, end = 0, [], spans[0][0]
    for start, stop in spans:
        if start > end:
            gaps.append(start - end)
        busy += max(0, stop - max(start, end))
        end = max(end, stop)
    span = end - spans[0][0]
    long = [g for g in gaps if g > 50_000]
    return (
        f"  device span {span / 1e6 / steps:.2f} ms/step, idle {(span - busy) / 1e6 / steps:.2f} ms/step "
        f"in {len(gaps) / steps:.0f} gaps/step ({len(long) / steps:.1f} over 50 us: {sum(long) / 1e6 / steps:.2f} ms)"
    )
