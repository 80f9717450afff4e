"""Micro-benchmark of jaxdist.comm on the GPUs present: per-call cost, blocking vs non-blocking.

Each variant is one jitted program of CALLS chained calls, unrolled (no loop,
so no per-iteration host sync). Every variant of one buffer size is timed
interleaved, rep after rep, so drift hits all of them alike; each figure is a
median over reps of a paired per-rep difference:

* "vs floor": (variant - memcpy) / CALLS, memcpy being an FFI handler that only
  copies the same bytes device to device (the floor of any FFI op);
* "nb - b": (non-blocking - blocking) / CALLS for the same op, the target is
  within 10 us at 8 B; "nb / b": the ratio of their costs above
  the empty program.

Both communicators live side by side (one mesh axis each over the same GPUs).
Non-blocking runs once per poll mode (`local`, the default; `yield`; `spin`:
see jaxdist.comm.nccl.set_poll_mode), the mode set for that program's run only.
Also printed: the xla backend (2+ GPUs), the group's cost (blocking all_reduce
with and without ncclGroupStart/End) and the flight recorder's (on vs off).

    python bench/nccl_micro.py [--calls 64] [--reps 30] [--sizes 8,65536,1048576,67108864]
    python bench/nccl_micro.py --sweep      # bus bandwidth, 8 KB .. 1 GB per rank

Appends its table to bench/RESULTS.md (--no-record: print only).
"""

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist import comm
from jaxdist.comm import nccl

sys.path.insert(0, os.path.dirname(__file__))
from results import append_result  # noqa: E402

OPS = ("all_reduce", "all_gather", "reduce_scatter", "sendrecv")
DEFAULT_POLL = "local"
POLL_MODES = ("local", "yield", "spin")  # the non-blocking variants; the first is jaxdist's default


def ungrouped_all_reduce(x, axis):
    be = nccl.nccl_backend()
    attrs = be._attrs("all_reduce", axis)
    return jax.ffi.ffi_call("jaxdist_bench_ungrouped", jax.ShapeDtypeStruct(x.shape, x.dtype), has_side_effect=True)(
        x, **attrs
    )


def one_call(op, x, t, axis, n):
    if op == "memcpy":
        return jax.ffi.ffi_call("jaxdist_memcpy", jax.ShapeDtypeStruct(x.shape, x.dtype), has_side_effect=True)(x), t
    name, backend = op.split(":")
    if name == "all_reduce_ungrouped":
        return ungrouped_all_reduce(x, axis), t
    if name == "all_reduce":
        return comm.all_reduce(x, axis, t, backend=backend)
    if name == "sendrecv":
        return comm.sendrecv(x, axis, t, perm=[(i, (i + 1) % n) for i in range(n)], backend=backend)
    if name == "all_gather":
        y, t = comm.all_gather(x, axis, t, backend=backend)
        return y[: x.shape[0]], t
    if name == "reduce_scatter":
        return comm.reduce_scatter(jnp.tile(x, n) if n > 1 else x, axis, t, backend=backend)
    raise ValueError(op)


def build(mesh, axis, op, calls):
    n = mesh.devices.size

    def body(x):
        t = comm.token()
        for _ in range(calls):
            if op != "empty":
                x, t = one_call(op, x, t, axis, n)
        return x

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis), check_vma=False))


def timed(f, x) -> float:
    t0 = time.perf_counter()
    f(x).block_until_ready()
    return time.perf_counter() - t0


def with_settings(f, *, poll: str = DEFAULT_POLL, recorder: bool = True):
    """`f` run under a poll mode and recorder setting: its host calls all happen before this returns."""

    def run(x):
        nccl.set_poll_mode(poll)
        nccl.set_recorder(recorder)
        try:
            return f(x).block_until_ready()
        finally:
            nccl.set_poll_mode(DEFAULT_POLL)
            nccl.set_recorder(True)

    run.f = f
    return run


def measure(programs: dict, reps: int) -> dict:
    """Interleaved timing of {name: (f, x)}: one run of every program per rep."""
    for f, x in programs.values():
        f(x).block_until_ready()  # compile and warm up
    times = {k: [] for k in programs}
    for _ in range(reps):
        for k, (f, x) in programs.items():
            times[k].append(timed(f, x))
    return {k: np.asarray(v) for k, v in times.items()}


# nccl-tests' bus bandwidth factors: busbw = algbw * factor(n), algbw = bytes per rank / time
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "sendrecv": lambda n: 1.0,
}


def sweep(gpus, calls: int, reps: int) -> None:
    """Bus bandwidth from 8 KB to 1 GB per rank, nccl vs xla (blocking communicators)."""
    n = len(gpus)
    mesh = Mesh(np.asarray(gpus), ("b",), axis_types=(AxisType.Explicit,))
    nccl.init(mesh, blocking=True)
    nccl.wait_ready()
    rows = []
    for nbytes in (8 << 10, 64 << 10, 512 << 10, 4 << 20, 32 << 20, 256 << 20, 1 << 30):
        x = jax.device_put(jnp.ones((n * nbytes // 4,), jnp.float32), NamedSharding(mesh, P("b")))
        ops = [f"{op}:{be}" for op in BUS_FACTOR for be in ("nccl", "xla")]
        programs = {op: (build(mesh, "b", op, calls), x) for op in ["empty", *ops]}
        times = measure(programs, reps)
        for op in ops:
            per_call = np.median(times[op] - times["empty"]) / calls
            algbw = nbytes / per_call / 1e9
            rows.append((op, nbytes, per_call * 1e6, algbw, algbw * BUS_FACTOR[op.split(":")[0]](n)))
    lines = [f"bus bandwidth, {n} x {gpus[0].device_kind}, {calls} calls, {reps} reps (nccl-tests formulas)", "```"]
    lines.append(f"{'op':24} {'bytes/rank':>11} {'us/call':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    lines += [f"{op:24} {nb:>11} {us:>10.1f} {alg:>11.1f} {bus:>11.1f}" for op, nb, us, alg, bus in rows]
    table = "\n".join([*lines, "```"])
    print("\n" + table)
    append_result(
        "NCCL bus bandwidth sweep", "python bench/nccl_micro.py --sweep", f"{n} x {gpus[0].device_kind}", table
    )


def per_call(times, a: str, b: str, calls: int) -> float:
    """Median over reps of (a - b) per call, in microseconds."""
    return float(np.median(times[a] - times[b]) / calls * 1e6)


def compare_size(gpus, meshes: dict, nbytes: int, calls: int, reps: int, poll_modes) -> list[str]:
    """One size: every op on the blocking and the non-blocking communicator (per poll mode), interleaved."""
    n = len(gpus)
    xs = {
        axis: jax.device_put(jnp.ones((n * max(nbytes // 4, 1),), jnp.float32), NamedSharding(mesh, P(axis)))
        for axis, mesh in meshes.items()
    }
    # every program runs through the same wrapper (its settings calls cost all variants alike)
    b, nb = meshes["b"], meshes["nb"]
    programs = {
        "empty": (with_settings(build(b, "b", "empty", calls)), xs["b"]),
        "memcpy": (with_settings(build(b, "b", "memcpy", calls)), xs["b"]),
    }
    for op in OPS:
        programs[f"{op} b"] = (with_settings(build(b, "b", f"{op}:nccl", calls)), xs["b"])
        nonblocking = build(nb, "nb", f"{op}:nccl", calls)
        for mode in poll_modes:
            programs[f"{op} nb {mode}"] = (with_settings(nonblocking, poll=mode), xs["nb"])
        if n > 1:
            programs[f"{op} xla"] = (with_settings(build(b, "b", f"{op}:xla", calls)), xs["b"])
    ungrouped = build(b, "b", "all_reduce_ungrouped:nccl", calls)
    programs["all_reduce b ungrouped"] = (with_settings(ungrouped), xs["b"])
    programs["all_reduce b recorder off"] = (with_settings(programs["all_reduce b"][0].f, recorder=False), xs["b"])
    t = measure(programs, reps)

    default = poll_modes[0]
    head = f"{'op':15} {'b vs floor':>10} {'nb vs floor':>11} {'nb - b':>8} {'nb / b':>7}"
    head += "".join(f" {'nb ' + m + ' - b':>14}" for m in poll_modes[1:])
    head += f" {'xla vs floor':>12}" if n > 1 else ""
    lines = [f"{nbytes} bytes per rank (us per call; nb = non-blocking, poll '{default}'; medians of paired diffs)"]
    lines.append(head)
    for op in OPS:
        blk, nbk = f"{op} b", f"{op} nb {default}"
        ratio = np.median(t[nbk] - t["empty"]) / max(np.median(t[blk] - t["empty"]), 1e-9)
        row = f"{op:15} {per_call(t, blk, 'memcpy', calls):>10.2f} {per_call(t, nbk, 'memcpy', calls):>11.2f}"
        row += f" {per_call(t, nbk, blk, calls):>8.2f} {ratio:>7.2f}"
        row += "".join(f" {per_call(t, f'{op} nb {m}', blk, calls):>14.2f}" for m in poll_modes[1:])
        row += f" {per_call(t, f'{op} xla', 'memcpy', calls):>12.2f}" if n > 1 else ""
        lines.append(row)
    memcpy_us = np.median(t["memcpy"] - t["empty"]) / calls * 1e6
    lines.append(
        f"floor: memcpy {memcpy_us:.2f} us/call above the empty program; blocking all_reduce: group start/end "
        f"{per_call(t, 'all_reduce b', 'all_reduce b ungrouped', calls):+.2f} us, flight recorder "
        f"{per_call(t, 'all_reduce b', 'all_reduce b recorder off', calls):+.2f} us"
    )
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sizes", default="8,65536,1048576,67108864", help="bytes per rank, comma-separated")
    ap.add_argument(
        "--modes-up-to", type=int, default=1 << 20, help="every poll mode up to this size; above, the default only"
    )
    ap.add_argument("--sweep", action="store_true", help="bus bandwidth 8 KB .. 1 GB instead (2+ GPUs)")
    ap.add_argument("--no-record", action="store_true", help="print only, do not append to bench/RESULTS.md")
    args = ap.parse_args()
    gpus = jax.devices("gpu")
    nccl.load()
    if args.sweep:
        return sweep(gpus, calls=min(args.calls, 8), reps=min(args.reps, 5))
    meshes = {axis: Mesh(np.asarray(gpus), (axis,), axis_types=(AxisType.Explicit,)) for axis in ("b", "nb")}
    nccl.init(meshes["b"], blocking=True)
    nccl.init(meshes["nb"], blocking=False)
    nccl.wait_ready()
    kind = gpus[0].device_kind
    lines = [f"{len(gpus)} x {kind}, jax {jax.__version__}, {args.calls} unrolled calls, {args.reps} reps", "```"]
    for nbytes in (int(s) for s in args.sizes.split(",")):
        modes = POLL_MODES if nbytes <= args.modes_up_to else POLL_MODES[:1]
        lines += compare_size(gpus, meshes, nbytes, args.calls, args.reps, modes) + [""]
        print("\n".join(lines[-len(OPS) - 4 :]), flush=True)  # progress: this size's block
    table = "\n".join([*lines[:-1], "```"])
    print("\n" + table)
    if not args.no_record:
        command = "python bench/nccl_micro.py " + " ".join(sys.argv[1:])
        append_result("NCCL micro-benchmark: blocking vs non-blocking", command, f"{len(gpus)} x {kind}", table)


if __name__ == "__main__":
    main()
