"""Where a checkpoint save's time goes: the call the loop waits for, the writes, the checksum pass,
side by side with the raw write bandwidth of the same directory (the same bytes, fsync'd, 1 and 8 threads).

A state of GPT's size (parameters and two Adam moments, float32, replicated on every visible
device as DDP holds them) is saved `--saves` times through `jaxdist.train.checkpoint.Checkpoints`,
each save waited for, and each phase timed:

* `save()`: what the training loop waits for when no save is in flight (enqueuing the copies into host
  memory; with several processes, the device-to-host copy itself);
* `background`: from `save()` returning to `wait()` returning: the copies, the writes (fsync'd) and the
  checksums; its GiB/s is the state's size over it;
* `copy`, `write`, `checksum`: the parts of `background` (`Checkpoints.timings`): waiting for the copies
  into host memory, the writes (the array files are summed as they are written), reading the other
  files back for their CRC-32.

Two forms side by side: the array files saves write (`jaxdist.train.array_files`), and orbax's
zstd-compressed zarr arrays (`run.checkpoint_compress=true`, and how saves were written before). A loop
that saves every k steps keeps up when the background part fits in k steps; the next save waits for
the rest. `--leaves` splits the state into as many arrays (a GPT-124M train state has ~450).

    python bench/checkpoint_breakdown.py --params 124e6 [--leaves 150] [--saves 4] [--dir DIR]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from checkpoint_write import raw_write  # noqa: E402
from results import append_result  # noqa: E402

from jaxdist.train import checkpoint as checkpoint_lib  # noqa: E402


def gpt_like_state(params: float, leaves: int = 48) -> dict:
    """Parameters and two moments of `params` float32 values in `leaves` arrays, replicated on every device."""
    size = int(params) // leaves
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices()), ("d",)), jax.P())
    make = jax.jit(lambda i: jnp.full((size,), i, jnp.float32), out_shardings=sharding, static_argnums=0)
    return {part: {f"w{i}": make(i) for i in range(leaves)} for part in ("params", "mu", "nu")}


def time_saves(state: dict, directory: Path, saves: int, compress: bool) -> dict[str, list[float]]:
    times = {"save()": [], "background": [], "copy": [], "write": [], "checksum": []}
    ckpt = checkpoint_lib.Checkpoints(directory, keep=2, compress=compress)
    try:
        for step in range(1, saves + 1):
            start = time.perf_counter()
            ckpt.save(step, state, {"step": step})
            returned = time.perf_counter()
            ckpt.wait()
            times["save()"].append(returned - start)
            times["background"].append(time.perf_counter() - returned)
            for part in ("copy", "write", "checksum"):
                times[part].append(ckpt.timings[f"{part}_s"])
    finally:
        ckpt.close()
    return {name: values[1:] or values for name, values in times.items()}  # the first save warms up


def raw_bandwidth(state: dict, directory: Path) -> dict[int, float]:
    """GiB/s of writing the state's bytes (one replica of each array) with fsync, from 1 and 8 threads."""
    host = [np.asarray(x) for x in jax.tree.leaves(state)]
    gib = sum(a.nbytes for a in host) / 2**30
    return {t: gib / statistics.median(raw_write(directory / f"raw{t}", host, t) for _ in range(3)) for t in (1, 8)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=124e6, help="model parameters (the state is 3x, float32)")
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--leaves", type=int, default=150, help="arrays per part (params, mu, nu)")
    p.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    args = p.parse_args()
    state = gpt_like_state(args.params, args.leaves)
    gib = 3 * 4 * args.params / 2**30
    base = Path(args.dir or tempfile.mkdtemp(prefix="jaxdist-ckpt-breakdown-"))
    raw = raw_bandwidth(state, base)
    variants = {"array files (default)": False, "orbax zarr, zstd (checkpoint_compress)": True}
    lines = [
        f"raw write, fsync'd: 1 thread {raw[1]:.2f} GiB/s, 8 threads {raw[8]:.2f} GiB/s",
        "",
        "| writes | save() s | background s | copy s | write s | checksum s | background GiB/s | vs raw 8 threads |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, compress in variants.items():
        times = time_saves(state, base / name.split()[0], args.saves, compress)
        med = {k: statistics.median(v) for k, v in times.items()}
        rate = gib / med["background"]
        cells = [f"{med[k]:.3f}" for k in ("save()", "background", "copy", "write", "checksum")]
        cells += [f"{rate:.2f}", f"{rate / raw[8]:.2f}"]
        lines.append(f"| {name} | {' | '.join(cells)} |")
        print(name, {k: [round(x, 3) for x in v] for k, v in times.items()}, flush=True)
    table = "\n".join(lines)
    print(table)
    if not args.no_record:
        device = (
            f"{jax.device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__}, {gib:.2f} GiB in "
            f"{3 * args.leaves} arrays, in {base}"
        )
        append_result("Checkpoint save breakdown (bench/checkpoint_breakdown.py)", " ".join(sys.argv), device, table)


if __name__ == "__main__":
    main()
