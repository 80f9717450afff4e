"""Each matmul of one GPU's training step: its shape, its time per step and the TFLOP/s it reaches,
from a `jax.profiler` trace of a few steps and the compiled step's HLO (dumped by XLA beside it).

    python bench/matmul_profile.py --flavor 1.3b --batch 8 --strategy "trainer default"

Where the step's matmuls as a whole run slower than cuBLAS does on the same shapes alone
(bench/matmul_kernels.py), this names the ones that do. A matmul is a cuBLAS custom call or a Triton GEMM
fusion of the optimized HLO; its FLOPs are 2 x the output's elements x the contracted size, counted
once per step (an op inside a loop of the step would be undercounted; the GPT's step has none). The SM
clock and power draw, sampled over untraced steps timed before the trace, say whether the step is
power-capped: the 989 TFLOP/s datasheet peak holds at 1830 MHz, and the matmuls' speed moves with the
clock.
"""

import argparse
import collections
import glob
import math
import os
import re
import shutil
import tempfile
import time

DUMP = tempfile.mkdtemp(prefix="matmul_profile_hlo_")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_dump_to={DUMP} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$"
    # no CUDA graphs: a graph's kernels all carry the graph's name, not their HLO op's
    + " --xla_gpu_enable_command_buffer="
)
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")

SHAPE = re.compile(r"(?:bf16|f16|f32|f8e4m3fn|f8e5m2)\[([0-9,]*)\]")


def dims(text: str) -> list[int]:
    m = SHAPE.search(text)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _lhs(args: str, operands: dict[str, list[int]]) -> list[int]:
    """The first operand's dims: printed beside it, or (newer HLO text prints names only) its definition's."""
    first = args.split(",")[0].strip()
    if SHAPE.search(first):
        return dims(first)
    return operands.get(first.split()[-1].lstrip("%"), [])


def matmul_shapes(hlo: str) -> dict[str, tuple[str, list[int], int]]:
    """HLO instruction name -> (how it runs, output dims, contracted size) for the cuBLAS calls and the
    GEMM fusions of one optimized module."""
    computations: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            current = head.group(1)
            computations[current] = []
        elif current:
            computations[current].append(line)
    operands: dict[str, list[int]] = {}
    for body in computations.values():
        for line in body:
            m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+\[[0-9,]*\])", line)
            if m:
                operands[m.group(1)] = dims(m.group(2))
    out = {}
    for body in computations.values():
        for line in body:
            m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*)$", line)
            if not m:
                continue
            name, rest = m.groups()
            if "custom-call(" in rest and "__cublas" in rest:
                args = re.search(r"custom-call\(([^)]*)\)", rest).group(1)
                lhs = _lhs(args, operands)
                contracting = re.search(r'"lhs_contracting_dimensions":\["?([0-9"\,]*)\]', rest)
                k = 1
                for d in contracting.group(1).replace('"', "").split(",") if contracting else []:
                    if d:
                        k *= lhs[int(d)] if int(d) < len(lhs) else 0
                out[name] = ("cublas", dims(rest), k)
            elif " fusion(" in rest and "kind=kCustom" in rest:
                called = re.search(r"calls=%?([\w.\-]+)", rest)
                for inner in computations.get(called.group(1) if called else "", []):
                    dot = re.search(r"= (\S+\[[0-9,]*\])\S* dot\(([^)]*)\).*lhs_contracting_dims=\{([0-9,]*)\}", inner)
                    if dot:
                        lhs_dims = _lhs(dot.group(2), operands)
                        k = 1
                        for d in dot.group(3).split(","):
                            k *= lhs_dims[int(d)] if int(d) < len(lhs_dims) else 0
                        out[name] = ("triton", dims(rest), k)
                        break
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="1.3b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--strategy", default="trainer default")
    p.add_argument("--steps", type=int, default=5, help="traced steps")
    p.add_argument("--timed", type=int, default=40, help="untraced steps timed, the clock sampled meanwhile")
    p.add_argument("--keep", help="a folder to copy the step's optimized HLO into")
    args = p.parse_args()

    import jax
    from gpu_clock import ClockSampler
    from jax.profiler import ProfileData
    from one_gpu import warmed_gpt_step

    run, state, batch, cfg = warmed_gpt_step(args.flavor, args.batch, args.strategy)
    with ClockSampler() as clocks:  # untraced steps, long enough for the card to settle: is it power-capped?
        start = time.perf_counter()
        for _ in range(args.timed):
            state, _ = run.step(state, batch)
        jax.block_until_ready(state)
        wall_ms = (time.perf_counter() - start) / args.timed * 1e3
    trace = tempfile.mkdtemp(prefix="matmul_profile_trace_")
    with jax.profiler.trace(trace):
        for _ in range(args.steps):
            state, _ = run.step(state, batch)
        jax.block_until_ready(state)

    # the step is the largest optimized module XLA dumped
    modules = sorted(glob.glob(f"{DUMP}/*after_optimizations.txt"), key=os.path.getsize)
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
        shutil.copy(modules[-1], args.keep)
    shapes = matmul_shapes(open(modules[-1]).read())
    data = ProfileData.from_file(sorted(glob.glob(f"{trace}/**/*.xplane.pb", recursive=True))[-1])
    gpus = sorted((q for q in data.planes if q.name.startswith("/device:GPU")), key=lambda q: q.name)
    if not gpus:
        raise SystemExit("no GPU in the trace: this script reads a GPU's kernels (cuBLAS calls, Triton GEMMs)")
    plane = gpus[0]
    lines = [line for line in plane.lines if line.name == "XLA Ops"] or [
        line for line in plane.lines if line.name.startswith("Stream")
    ]
    per_shape: dict[tuple, list[float]] = collections.defaultdict(list)
    ops_of_shape: dict[tuple, set[str]] = collections.defaultdict(set)
    busy_us = 0.0
    for line in lines:
        for event in line.events:
            busy_us += event.duration_ns / 1e3
            op = dict(event.stats).get("hlo_op", event.name)
            if op in shapes:
                how, out, k = shapes[op]
                per_shape[(how, tuple(out), k)].append(event.duration_ns / 1e3)
                ops_of_shape[(how, tuple(out), k)].add(op)  # a cuBLAS call may run as more than one kernel
    if not per_shape:
        first = next((e for line in lines for e in line.events), None)
        raise SystemExit(f"no matmul found in the trace; an event: {first and (first.name, dict(first.stats))}")
    rows = []
    for (how, out, k), us in per_shape.items():
        ms = sum(us) / args.steps / 1e3
        ops = len(ops_of_shape[(how, out, k)])  # each runs once per step
        rows.append((ms, how, out, k, 2 * math.prod(out) * k * ops / ms / 1e9, ops))
    rows.sort(reverse=True)
    total_ms = sum(r[0] for r in rows)
    total_tf = sum(r[4] * r[0] for r in rows) / total_ms
    print(f"GPT-{args.flavor}, {args.batch} x {cfg.seq_len}, {args.strategy}; module {os.path.basename(modules[-1])}")
    busy_ms = busy_us / args.steps / 1e3
    print(f"{wall_ms:.2f} ms/step over {args.timed} untraced steps; kernels busy {busy_ms:.2f} ms/step traced")
    print(f"matmuls {total_ms:.2f} ms/step at {total_tf:.0f} TFLOP/s, {len(rows)} shapes")
    print(f"over the untraced steps: {clocks.summary()}")
    if clocks.mean_clock():
        at_clock = 989 * clocks.mean_clock() / 1830
        print(f"the matmuls reach {total_tf / at_clock:.0%} of the bf16 peak at that clock, {at_clock:.0f} TFLOP/s")
    print(f"{'ms/step':>8} {'ops':>5} {'TFLOP/s':>8}  {'how':7} {'output':>18} {'K':>6}")
    for ms, how, out, k, tf, ops in rows:
        print(f"{ms:8.3f} {ops:5d} {tf:8.0f}  {how:7} {'x'.join(map(str, out)):>18} {k:6d}")


if __name__ == "__main__":
    main()
