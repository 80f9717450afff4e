"""Micro-benchmark of jaxdist.comm on the GPUs present: nccl vs xla backend.

Per-call cost is measured inside a jitted fori_loop of CALLS chained calls, so
Python dispatch is amortized, next to an FFI handler that only copies the same
bytes device to device (the floor of any FFI op) and an empty loop. Small
messages give latency, large ones bandwidth. Prints a table last.

    python bench/nccl_micro.py [--calls 100] [--reps 20]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist import comm
from jaxdist.comm import nccl


def build(mesh, axis, op, calls):
    n = mesh.devices.size

    def one(x, t):
        if op == "empty":
            return x + 1, t
        if op == "memcpy":
            return jax.ffi.ffi_call("jaxdist_memcpy", jax.ShapeDtypeStruct(x.shape, x.dtype))(x), t
        name, backend, *mode = op.split(":")
        if name == "all_reduce":
            return comm.all_reduce(x, axis, t, backend=backend)
        if name == "sendrecv":
            return comm.sendrecv(x, axis, t, perm=[(i, (i + 1) % n) for i in range(n)], backend=backend)
        if name == "all_gather":
            y, t = comm.all_gather(x, axis, t, backend=backend)
            return y[: x.shape[0]], t
        if name == "reduce_scatter":
            y, t = comm.reduce_scatter(jnp.tile(x, n), axis, t, backend=backend)
            return y, t
        raise ValueError(op)

    def body(x):
        def step(i, c):
            return one(*c)

        x, t = jax.lax.fori_loop(0, calls, step, (x, comm.token()))
        return x

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis), check_vma=False))


def seconds(f, x, reps):
    f(x).block_until_ready()
    best = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        best.append(time.perf_counter() - t0)
    return float(np.median(best))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    gpus = jax.devices("gpu")
    rows = []
    for blocking in (True, False):
        axis = "b" if blocking else "nb"
        mesh = Mesh(np.asarray(gpus), (axis,), axis_types=(AxisType.Explicit,))
        nccl.init(mesh, blocking=blocking)
        nccl.wait_ready()
        for nbytes in (8, 64 << 20):  # latency (8 B) and bandwidth (64 MiB)
            x = jax.device_put(jnp.ones((len(gpus) * nbytes // 4,), jnp.float32), NamedSharding(mesh, P(axis)))
            base = seconds(build(mesh, axis, "empty", args.calls), x, args.reps)
            ops = [
                "memcpy",
                "all_reduce:nccl",
                "all_reduce:xla",
                "sendrecv:nccl",
                "sendrecv:xla",
                "all_gather:nccl",
                "all_gather:xla",
                "reduce_scatter:nccl",
                "reduce_scatter:xla",
            ]
            for op in ops:
                # XLA removes one-device collectives, so xla rows mean something only with 2+ GPUs
                if op.endswith(":xla") and (not blocking or len(gpus) == 1):
                    continue
                t = seconds(build(mesh, axis, op, args.calls), x, args.reps)
                per_call_us = (t - base) / args.calls * 1e6
                rows.append(
                    (
                        op,
                        "blocking" if blocking else "non-blocking",
                        nbytes,
                        per_call_us,
                        nbytes / (t / args.calls) / 1e9,
                    )
                )
            rows.append(
                (
                    "(loop step)",
                    "blocking" if blocking else "non-blocking",
                    nbytes,
                    base / args.calls * 1e6,
                    float("nan"),
                )
            )
    print(f"\n{len(gpus)} x {gpus[0].device_kind}, jax {jax.__version__}, {args.calls} chained calls per loop")
    print(f"{'op':24} {'mode':13} {'bytes/rank':>11} {'us/call above loop':>19} {'GB/s':>8}")
    for op, mode, nbytes, us, gbs in rows:
        print(f"{op:24} {mode:13} {nbytes:>11} {us:>19.2f} {gbs:>8.1f}")


if __name__ == "__main__":
    main()
