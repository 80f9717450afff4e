"""Does the host or the device run a pipeline's tick loop? The loop's form in isolation, on one GPU.

A pipelined step is a `lax.scan` over the schedule's ticks whose body picks the rank's op with a
`lax.switch` on a value read from the table by the device's pp rank: a predicate that lives on the
device. This program has the same form on one device (the rank is a device value too, so XLA cannot
fold it): `--ticks` ticks, each running one of `--ops` branches of `--layers` matmul + GELU layers on
a (`--rows`, `--d`) bfloat16 activation. Each form runs in its own process:

* `switch`: the scan and the switch as the pipeline has them, XLA's defaults;
* `switch+graphs`: the same program with XLA's command buffers holding conditionals and loops
  (`--xla_gpu_enable_command_buffer` with CONDITIONAL and WHILE), so the device picks the branch;
* `static`: the ticks unrolled with each tick's op known at trace time (what a per-rank program
  traces): the bound;
* `masked`: every branch every tick, the rank's result selected (no conditional, the work of all).

Reported per form: the step's wall time (median over `--iters`, waited for), the host's time to
dispatch it (the call's return, not waited for), and dispatch / step; the kernels' share is the
step / the static form's.

    python bench/tick_dispatch.py [--ticks 24] [--ops 3] [--layers 4] [--rows 2048] [--d 2048]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"
FORMS = {"switch": "", "switch+graphs": COMMAND_BUFFERS, "static": "", "masked": ""}


def child(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    rng = np.random.default_rng(0)
    ws = jnp.asarray(rng.normal(size=(args.ops, args.layers, args.d, args.d)) / args.d**0.5, jnp.bfloat16)
    x0 = jnp.asarray(rng.normal(size=(args.rows, args.d)), jnp.bfloat16)
    table = rng.integers(0, args.ops, args.ticks).astype(np.int32)

    def branch(k):
        def run(x):
            for layer in range(args.layers):
                x = jax.nn.gelu(x @ ws[k, layer])
            return x

        return run

    branches = [branch(k) for k in range(args.ops)]

    if args.form in ("switch", "switch+graphs"):

        def step(x, table):
            def tick(x, op):
                return lax.switch(op, branches, x), None

            return lax.scan(tick, x, table)[0]

    elif args.form == "static":

        def step(x, table):
            for op in table_static:
                x = branches[int(op)](x)
            return x

        table_static = table
    else:

        def step(x, table):
            def tick(x, op):
                outs = jnp.stack([b(x) for b in branches])
                return lax.dynamic_index_in_dim(outs, op, keepdims=False), None

            return lax.scan(tick, x, table)[0]

    fn = jax.jit(step)
    table_d = jnp.asarray(table)
    jax.block_until_ready(fn(x0, table_d))
    walls, dispatch = [], []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        out = fn(x0, table_d)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        dispatch.append(t1 - t0)
        walls.append(t2 - t0)
    return {"ms": 1e3 * statistics.median(walls), "dispatch_ms": 1e3 * statistics.median(dispatch)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ticks", type=int, default=24)
    parser.add_argument("--ops", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--form", choices=FORMS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.form:
        print("RESULT " + json.dumps(child(args)))
        return
    rows = {}
    for form, flags in FORMS.items():
        env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()}
        cmd = [sys.executable, __file__, "--form", form, *sys.argv[1:]]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            print(f"{form}: failed\n{done.stderr[-1500:]}")
            continue
        rows[form] = json.loads(lines[-1][len("RESULT ") :])
    bound = rows.get("static", {}).get("ms")
    print(f"\n{args.ticks} ticks, {args.ops} ops of {args.layers} layers, ({args.rows}, {args.d}) bf16\n")
    print("| form | ms/step | host dispatch ms | dispatch / step | step / static |")
    print("| --- | --- | --- | --- | --- |")
    for form, r in rows.items():
        ratio = f"{r['ms'] / bound:.2f}x" if bound else "-"
        print(f"| {form} | {r['ms']:.2f} | {r['dispatch_ms']:.2f} | {r['dispatch_ms'] / r['ms']:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
