"""What do asynchronous checkpoints cost a training loop? The trainer with a checkpoint every step
and every 10 steps, side by side with no checkpoints, in one run.

Each configuration is `jaxdist train` in its own process (GPT, synthetic data, the default
strategy over all visible devices); its throughput is the mean of the trainer's own
tokens/s windows (`run.log_every` steps each, the saves of those steps included) after the
first window (compilation). A checkpoint every step cannot be cheaper than the device-to-host
copy of the state (orbax's blocking part) nor, in steady state, than writing its bytes, since
a save waits for the one in flight: the table gives the checkpoint's size so the bound can be
read off.

    python bench/checkpoint_overhead.py --flavor 124m --batch 16 --steps 60 [--every 0,10,1] [--dir /dev/shm/ckpt]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from results import append_result  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def config_name(every: int) -> str:
    return "no checkpoints" if every <= 0 else "every step" if every == 1 else f"every {every} steps"


def run(out: Path, args, every: int, launcher: list[str] | None = None) -> dict:
    """One `jaxdist train` process (`launcher`: what runs the CLI, default `python -m jaxdist.train.cli`)."""
    cmd = [*(launcher or [sys.executable, "-m", "jaxdist.train.cli"]), "train", f"model.flavor={args.flavor}"]
    cmd += [f"model.dtype={args.dtype}", "data.source=synthetic", f"data.batch_size={args.batch}"]
    cmd += [f"run.steps={args.steps}", f"run.log_every={args.window}", f"run.checkpoint_every={every}"]
    cmd += [f"run.out_dir={out}", "run.progress=false", "run.keep_checkpoints=2", *args.extra]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in rows[1:]]  # the first window compiles
    waits = [r.get("checkpoint_s", 0.0) for r in rows[1:]]
    size = sum(f.stat().st_size for f in (out / "checkpoints").rglob("*") if f.is_file()) if every > 0 else 0
    kept = len([d for d in (out / "checkpoints").iterdir() if d.is_dir()]) if every > 0 else 1
    return {
        "tokens_per_s": statistics.mean(rates),
        "windows": len(rates),
        "ckpt_bytes": size / max(1, kept),
        "wait_s": statistics.mean(waits),
    }


def add_run_arguments(p: argparse.ArgumentParser, steps: int) -> None:
    """The options of the trainer runs `run` makes (model, batch, steps, window, directory, recording)."""
    p.add_argument("--flavor", default="124m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=16, help="global sequences per step")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--window", type=int, default=10, help="steps per tokens/s window (run.log_every)")
    p.add_argument("--dir", default=None, help="where the runs write (default: a temporary directory)")
    p.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p, steps=60)
    p.add_argument("--every", default="0,10,1", help="checkpoint intervals to run, in steps (0: none, the reference)")
    p.add_argument("extra", nargs="*", help="more trainer overrides, e.g. parallel.fsdp=2")
    args = p.parse_args()
    intervals = [int(e) for e in args.every.split(",")]
    if 0 not in intervals:
        intervals.insert(0, 0)  # the reference
    base = Path(args.dir or tempfile.mkdtemp(prefix="jaxdist-ckpt-bench-"))
    results = {}
    for every in intervals:
        name = config_name(every)
        out = base / name.replace(" ", "_")
        shutil.rmtree(out, ignore_errors=True)
        results[name] = run(out, args, every if every > 0 else -1)
        shutil.rmtree(out, ignore_errors=True)
        print(name, results[name], flush=True)
    ref = results["no checkpoints"]["tokens_per_s"]
    lines = [
        "| checkpoints | tokens/s | time vs none | checkpoint size | loop waits in saves (s per window) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        size = f"{r['ckpt_bytes'] / 2**30:.2f} GiB" if r["ckpt_bytes"] else "-"
        wait = f"{r['wait_s']:.3f}" if r["ckpt_bytes"] else "-"
        lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {ref / r['tokens_per_s']:.3f}x | {size} | {wait} |")
    table = "\n".join(lines)
    print(table)
    if not args.no_record:
        import jax

        device = f"{jax.device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__}, writing to {base}"
        append_result("Checkpoint overhead (bench/checkpoint_overhead.py)", " ".join(sys.argv), device, table)


if __name__ == "__main__":
    main()
