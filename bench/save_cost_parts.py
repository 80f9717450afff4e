"""Which part of a checkpoint save costs the training loop? `jaxdist train` with a save every N steps, run
with parts of the save left out, side by side with no checkpoints, each configuration in its own process.

    python bench/save_cost_parts.py --flavor 124m --batch 16 --steps 110 --every 10 [--dir /dev/shm/parts]

Configurations (tokens/s: the mean of the trainer's own windows after the first, as in
`bench/checkpoint_overhead.py`):

* no checkpoints: the reference.
* host copies only: each save stages its copies into host memory as usual (the conversion, the
  device-to-host transfers, the NaN/Inf check) and its background part waits for them, but nothing is
  written: what the transfers and the loop's own save work cost.
* full: the save as the trainer makes it (the copies, then the files written, fsync'd, checksummed and
  renamed into place by the background part).
* full, 0.5 ms switch interval: the same with `sys.setswitchinterval(0.0005)`, so that the main thread
  waits at most 0.5 ms (not 5) for the interpreter lock the save's threads hold.

The gap between "host copies only" and "full" is what the background writes cost the loop (the
interpreter lock and the host's memory bandwidth they share with it); the gap between "no checkpoints"
and "host copies only" is the transfers' and the loop's own save work.
"""

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
import checkpoint_overhead  # noqa: E402
from results import append_result  # noqa: E402

VARIANTS = {  # name -> (saves?, what the child changes)
    "no checkpoints": (False, None),
    "host copies only": (True, "copies_only"),
    "full": (True, None),
    "full, 0.5 ms switch interval": (True, "switch"),
}


def child(change: str | None, argv: list[str]) -> int:
    """Run the trainer's CLI on `argv` in this process, with `change` applied first."""
    from jaxdist.train import checkpoint, cli
    from jaxdist.train.host_copy import wait_for_host_copy

    if change == "copies_only":

        def copies_only(self, step, args):  # single process: `save` hands the staged copies to this thread
            began = time.perf_counter()
            for item in ("arrays", "state"):  # the array files, or orbax's compressed form
                if args is not None and item in args:
                    wait_for_host_copy(args[item].item)
            self.timings = {"copy_s": time.perf_counter() - began, "write_s": 0.0, "checksum_s": 0.0}

        checkpoint.Checkpoints._finish = copies_only
    elif change == "switch":
        sys.setswitchinterval(0.0005)
    return cli.main(argv)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        change = None if sys.argv[2] == "-" else sys.argv[2]
        raise SystemExit(child(change, sys.argv[3:]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    checkpoint_overhead.add_run_arguments(p, steps=110)
    p.add_argument("--every", type=int, default=10, help="a save every this many steps")
    p.add_argument("extra", nargs="*", help="more trainer overrides")
    args = p.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="jaxdist-save-parts-"))
    results = {}
    for name, (saves, change) in VARIANTS.items():
        out = base / name.replace(" ", "_").replace(",", "").replace(".", "")
        shutil.rmtree(out, ignore_errors=True)
        launcher = [sys.executable, os.path.abspath(__file__), "--child", change or "-"]
        results[name] = checkpoint_overhead.run(out, args, args.every if saves else -1, launcher)
        shutil.rmtree(out, ignore_errors=True)
        print(name, results[name], flush=True)
    ref = results["no checkpoints"]["tokens_per_s"]
    lines = [
        f"GPT-{args.flavor}, {args.batch} x seq_len tokens, {args.dtype}, {args.steps} steps, a save every "
        f"{args.every} steps, into {base}",
        "",
        "| configuration | tokens/s | tokens/s vs none | loop waits in saves (s per window) |",
        "| --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        wait = f"{r['wait_s']:.3f}" if VARIANTS[name][0] else "-"
        lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / ref:.3f} | {wait} |")
    table = "\n".join(lines)
    print(table)
    if not args.no_record:
        import jax

        device = f"{jax.device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__}"
        title = "Which part of a save costs the loop (bench/save_cost_parts.py)"
        append_result(title, " ".join(sys.argv), device, table)


if __name__ == "__main__":
    main()
