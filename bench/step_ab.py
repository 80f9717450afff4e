"""The one-GPU step of several jaxdist checkouts side by side: the trainer's default strategy on a GPT
flavor, each (checkout, flavor) in its own process, in one run.

    git worktree add /tmp/jaxdist-base HEAD~3          # the baseline, beside this checkout
    python bench/step_ab.py --root base=/tmp/jaxdist-base --root new=. --flavor 350m:16 --flavor 1.3b:8

Per configuration: ms/step (the median of three windows of 10 steps dispatched back to back), MFU
on 989 TFLOP/s (6 N + 12 L d T per token), the device's peak GiB, the first three losses (to see that
the variants compute the same thing) and the host's time in each `step()` call: when it is close to
the step, the host waits for the device at every step and the device waits for the host's dispatch
in turn. `--xla-flags` sets XLA_FLAGS for every configuration (e.g. to A/B a flag, run the same
root twice under two names with `--root a=. --root b=.`, and `--flags-for b=--xla_...`).
"""

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULT = "STEP_AB "


def child(root: str, flavor: str, batch_size: int) -> None:
    # this checkout's jaxdist, not an installed one: drop an editable install's import hook
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, os.path.abspath(root))
    sys.path.insert(0, os.path.dirname(__file__))
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from one_gpu import build

    import jaxdist
    from jaxdist.models.gpt import FLAVORS, GPT
    from jaxdist.train.trainer import flops_per_token

    gpu = jax.default_backend() == "gpu"
    cfg = dataclasses.replace(FLAVORS[flavor], dtype=jnp.bfloat16, attention="cudnn" if gpu else None)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), dtype=np.int32)
    batch = {"tokens": jnp.asarray(tokens)}
    with jax.default_device(jax.devices("cpu")[0]):
        model = GPT(cfg, nnx.Rngs(0))
    run = build("trainer default", model, batch, flavor, not gpu)
    state, losses = run.state, []
    for _ in range(3):
        state, metrics = run.step(state, batch)
        losses.append(float(metrics["loss"]))
    windows, calls = [], []
    for _ in range(3):
        jax.block_until_ready(state)
        start = time.perf_counter()
        for _ in range(10):
            called = time.perf_counter()
            state, metrics = run.step(state, batch)
            calls.append(time.perf_counter() - called)
        jax.block_until_ready(state)
        windows.append((time.perf_counter() - start) / 10)
    seconds = statistics.median(windows)
    stats = jax.devices()[0].memory_stats() or {}
    out = {
        "ms": 1e3 * seconds,
        "mfu": batch_size * cfg.seq_len * flops_per_token(cfg) / seconds / 989e12,
        "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
        "losses": losses,
        "call_ms": 1e3 * statistics.median(calls),
        "jaxdist": os.path.dirname(os.path.dirname(jaxdist.__file__)),
    }
    print(RESULT + json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", action="append", default=[], help="NAME=PATH of a jaxdist checkout (repeatable)")
    p.add_argument("--flavor", action="append", default=[], help="FLAVOR:BATCH, e.g. 350m:16 (repeatable)")
    p.add_argument("--flags-for", action="append", default=[], help="NAME=XLA_FLAGS for one root's runs")
    p.add_argument("--timeout", type=int, default=300, help="seconds per configuration")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], int(args.child[2]))
    roots = dict(r.split("=", 1) for r in args.root) or {"this": str(Path(__file__).resolve().parents[1])}
    flags = dict(f.split("=", 1) for f in args.flags_for)
    flavors = [f.split(":") for f in args.flavor] or [["350m", "16"]]
    rows = ["| flavor x batch | checkout | ms/step | MFU | peak GiB | host ms in step() | first losses |"]
    rows.append("|" + " --- |" * 7)
    for flavor, batch in flavors:
        for name, root in roots.items():
            env = dict(os.environ)
            if name in flags:
                env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags[name]).strip()
            cmd = [sys.executable, __file__, "--child", root, flavor, batch]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
                found = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
                r = json.loads(found[-1][len(RESULT) :]) if found else {"error": (done.stderr.strip() or "?")[-200:]}
            except subprocess.TimeoutExpired:
                r = {"error": f"over {args.timeout} s"}
            print(flavor, batch, name, r, flush=True)
            if "error" in r:
                rows.append(f"| {flavor} x {batch} | {name} | {r['error']} | | | | |")
                continue
            losses = ", ".join(f"{x:.4f}" for x in r["losses"])
            rows.append(
                f"| {flavor} x {batch} | {name} | {r['ms']:.2f} | {100 * r['mfu']:.1f}% | {r['peak_gib']:.1f} | "
                f"{r['call_ms']:.1f} | {losses} |"
            )
    print("\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
