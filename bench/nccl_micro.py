"""Micro-benchmark of jaxdist.comm on the GPUs present: per-call cost and bandwidth.

Each variant is one jitted program of CALLS chained calls, unrolled (no loop,
so no per-iteration host sync), on an 8-byte (latency) or 64 MiB (bandwidth)
buffer. Variants are timed interleaved, rep after rep, so drift hits all of
them alike; each figure is a median over reps, and "vs floor" is the median of
the per-rep difference to `memcpy`, an FFI handler that only copies the same
bytes device to device (the floor of any FFI op).

Rows: every nccl op (blocking and non-blocking communicators); the xla backend
(2+ GPUs: XLA removes one-device collectives); `all_reduce ungrouped`, the same
all-reduce without ncclGroupStart/End around it (benchmark-only target), whose
difference is the group's cost; non-blocking rows with the poll in "spin" mode
next to the default "yield"; `all_reduce recorder off`, the same program run with the
flight recorder switched off, whose difference is the recorder's cost per call
(`--recorder off` runs every row without it). Results are appended to bench/RESULTS.md by hand.

    python bench/nccl_micro.py [--calls 64] [--reps 30] [--recorder on|off]
    python bench/nccl_micro.py --sweep      # bus bandwidth, 8 KB .. 1 GB per rank
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


def recorder_off(f):
    """`f` run with the flight recorder off: its host calls all happen before this returns."""

    def run(x):
        nccl.set_recorder(False)
        try:
            return f(x).block_until_ready()
        finally:
            nccl.set_recorder(True)

    return run


def measure(programs: dict, x, reps: int) -> dict:
    """Interleaved timing: one run of every program per rep."""
    for f in programs.values():
        f(x).block_until_ready()  # compile and warm up
    times = {k: [] for k in programs}
    for _ in range(reps):
        for k, f in programs.items():
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
        programs = {op: build(mesh, "b", op, calls) for op in ["empty", *ops]}
        times = measure(programs, x, reps)
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


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sweep", action="store_true", help="bus bandwidth 8 KB .. 1 GB instead (2+ GPUs)")
    ap.add_argument("--recorder", choices=("on", "off"), default="on", help="the flight recorder (default on)")
    args = ap.parse_args()
    gpus = jax.devices("gpu")
    nccl.load()
    nccl.set_recorder(args.recorder == "on")
    if args.sweep:
        return sweep(gpus, calls=min(args.calls, 8), reps=min(args.reps, 5))
    rows = []
    for mode in ("blocking", "non-blocking", "non-blocking spin"):
        blocking = mode == "blocking"
        axis = {"blocking": "b", "non-blocking": "nb", "non-blocking spin": "nb"}[mode]
        mesh = Mesh(np.asarray(gpus), (axis,), axis_types=(AxisType.Explicit,))
        nccl.init(mesh, blocking=blocking)
        nccl.wait_ready()
        nccl.set_poll_mode("spin" if mode.endswith("spin") else "yield")
        for nbytes in (8, 64 << 20):
            if mode.endswith("spin") and nbytes > 8:
                continue
            x = jax.device_put(jnp.ones((len(gpus) * nbytes // 4,), jnp.float32), NamedSharding(mesh, P(axis)))
            ops = ["memcpy", "all_reduce:nccl", "sendrecv:nccl", "all_gather:nccl", "reduce_scatter:nccl"]
            if blocking:
                ops.append("all_reduce_ungrouped:nccl")
            if len(gpus) > 1 and blocking:
                ops += ["all_reduce:xla", "sendrecv:xla", "all_gather:xla", "reduce_scatter:xla"]
            programs = {op: build(mesh, axis, op, args.calls) for op in ["empty", *ops]}
            if blocking and args.recorder == "on":
                ops.append("all_reduce recorder off:nccl")
                programs[ops[-1]] = recorder_off(programs["all_reduce:nccl"])
            times = measure(programs, x, args.reps)
            floor = times["memcpy"]
            for op in ops:
                per_call = np.median(times[op] - times["empty"]) / args.calls * 1e6
                vs_floor = np.median(times[op] - floor) / args.calls * 1e6
                spread = np.subtract(*np.percentile((times[op] - floor) / args.calls * 1e6, [75, 25]))
                gbs = nbytes / (np.median(times[op]) / args.calls) / 1e9
                rows.append((op, mode, nbytes, per_call, vs_floor, spread, gbs))
            if blocking:
                grouped, ungrouped = times["all_reduce:nccl"], times["all_reduce_ungrouped:nccl"]
                cost = np.median(grouped - ungrouped) / args.calls * 1e6
                rows.append(("(group start/end cost)", mode, nbytes, cost, float("nan"), float("nan"), float("nan")))
            if blocking and args.recorder == "on":
                on, off = times["all_reduce:nccl"], times["all_reduce recorder off:nccl"]
                cost = np.median(on - off) / args.calls * 1e6
                rows.append(("(flight recorder cost)", mode, nbytes, cost, float("nan"), float("nan"), float("nan")))
    nccl.set_poll_mode("yield")
    kind = gpus[0].device_kind
    lines = [f"{len(gpus)} x {kind}, jax {jax.__version__}, {args.calls} unrolled calls, {args.reps} reps", "```"]
    lines.append(f"{'op':28} {'mode':18} {'bytes/rank':>10} {'us/call':>8} {'vs floor':>9} {'IQR':>6} {'GB/s':>7}")
    for op, mode, nbytes, us, vs, iqr, gbs in rows:
        lines.append(f"{op:28} {mode:18} {nbytes:>10} {us:>8.2f} {vs:>9.2f} {iqr:>6.2f} {gbs:>7.1f}")
    table = "\n".join([*lines, "```"])
    print("\n" + table)
    command = "python bench/nccl_micro.py " + " ".join(sys.argv[1:])
    append_result("NCCL micro-benchmark", command, f"{len(gpus)} x {kind}", table)


if __name__ == "__main__":
    main()
