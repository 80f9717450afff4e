"""MFU through `jaxdist train` itself: each configuration is one `jaxdist train` process on synthetic
data (its own peak memory, a crash costs only its row), and its steady pace is the median of the
metrics rows after the first (which includes the compile).

    python bench/train_mfu.py                          # on one GPU: the rows of docs/benchmarks.md
    python bench/train_mfu.py --only gpt-1.3b,llama3-1b-4k
    python bench/train_mfu.py --cpu                    # tiny models on the CPU: checks the script

MFU is tokens/s x FLOPs per token / the device's datasheet dense bf16 peak (989 TFLOP/s for H100
and H200), as the trainer's metrics rows report it (`jaxdist.train.trainer.flops_per_token`). Beside
it, the SM clock and power under load (nvidia-smi's samples drawing at least 60% of the run's highest
power, i.e. its steps): an H200 runs these steps at its 700 W limit, below its top clock, and how far
below moves a run's MFU by a few percent from one machine to the next.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from gpu_clock import ClockSampler  # noqa: E402
from results import append_result  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

BF16 = ["model.dtype=bfloat16", "data.source=synthetic", "run.checkpoint_every=0", "run.progress=false"]
# name: the keys after the common ones (batch and sequence as the measurements in the docs name them)
CONFIGS = {
    "gpt-350m-16k": ["model.flavor=350m", "data.batch_size=16", "model.seq_len=1024"],
    "gpt-350m-16k-chunked": ["model.flavor=350m", "data.batch_size=16", "model.seq_len=1024", "model.loss_chunk=2048"],
    "gpt-1.3b": ["model.flavor=1.3b", "data.batch_size=8", "model.seq_len=1024"],
    "gpt-1.3b-chunked": ["model.flavor=1.3b", "data.batch_size=8", "model.seq_len=1024", "model.loss_chunk=2048"],
    # opt-in numerics: AdamW's first moment in bfloat16 (less optimizer traffic; not the default)
    "gpt-350m-16k-mu-bf16": [
        "model.flavor=350m",
        "data.batch_size=16",
        "model.seq_len=1024",
        "optim.mu_dtype=bfloat16",
    ],
    "gpt-1.3b-mu-bf16": ["model.flavor=1.3b", "data.batch_size=8", "model.seq_len=1024", "optim.mu_dtype=bfloat16"],
    "llama3-1b-4k": ["model.family=llama", "model.flavor=llama3-1b", "data.batch_size=4", "model.seq_len=4096"],
}
CPU_CONFIGS = {
    "gpt-tiny": ["model.flavor=tiny", "data.batch_size=8"],
    "llama-tiny": ["model.family=llama", "model.flavor=tiny", "data.batch_size=8"],
}


def measure(name: str, keys: list[str], steps: int, timeout: int, cpu: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="jaxdist-mfu-") as out:
        # the CLI of this checkout (as `jaxdist train` runs it), whether or not the package is installed
        argv = [sys.executable, "-m", "jaxdist.train.cli", "train", *BF16, *keys, f"run.steps={steps}"]
        argv += ["run.log_every=5", f"run.out_dir={out}"]
        env = dict(os.environ, JAX_PLATFORMS="cpu") if cpu else os.environ
        try:
            with ClockSampler() as clocks:
                done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
        except subprocess.TimeoutExpired:
            return {"error": f"over {timeout} s"}
        rows = (
            [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
            if (Path(out) / "metrics.jsonl").exists()
            else []
        )
        steady = [r for r in rows if not r.get("includes_compile") and "tokens_per_s" in r]
        if done.returncode or not steady:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            return {"error": tail[0][:200]}
        return {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
            "mfu": statistics.median(r["mfu"] for r in steady) if "mfu" in steady[0] else None,
            "mem_gb": max(r.get("mem_gb", 0.0) for r in steady),
            "losses": [round(r["loss"], 4) for r in rows if "loss" in r],  # to compare runs' curves
            "clock_mhz_w": None if cpu else clocks.under_load(),
        }


def table(results: dict) -> str:
    lines = ["| configuration | keys | tokens/s | MFU | GiB in use | SM clock, power under load |"]
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        keys = " ".join(CONFIGS.get(name, CPU_CONFIGS.get(name, [])))
        if "error" in r:
            lines.append(f"| {name} | `{keys}` | {r['error']} | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        clock = f"{r['clock_mhz_w'][0]:.0f} MHz, {r['clock_mhz_w'][1]:.0f} W" if r.get("clock_mhz_w") else "-"
        lines.append(f"| {name} | `{keys}` | {r['tokens_per_s']:,.0f} | {mfu} | {r['mem_gb']:.1f} | {clock} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="tiny models on the CPU (checks the script; not recorded)")
    p.add_argument("--only", default="", help="comma-separated configuration names (default: all)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 30; --cpu 10)")
    p.add_argument("--timeout", type=int, default=240, help="seconds per configuration")
    p.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    args = p.parse_args()
    configs = CPU_CONFIGS if args.cpu else CONFIGS
    names = [n for n in args.only.split(",") if n] or list(configs)
    unknown = [n for n in names if n not in configs]
    if unknown:
        p.error(f"unknown configuration {unknown[0]!r}; choose from {', '.join(configs)}")
    steps = args.steps or (10 if args.cpu else 30)
    results = {}
    for name in names:
        results[name] = measure(name, configs[name], steps, args.timeout, args.cpu)
        print(name, results[name], flush=True)
    header = f"`jaxdist train` {' '.join(BF16)}, {steps} steps, median of the rows after the compile"
    text = table(results)
    print(f"\n{header}\n\n{text}")
    if not (args.cpu or args.no_record):
        append_result("MFU through jaxdist train", "python bench/train_mfu.py " + " ".join(sys.argv[1:]), header, text)


if __name__ == "__main__":
    main()
