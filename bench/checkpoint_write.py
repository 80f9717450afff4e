"""Where a checkpoint save's time goes, by how orbax writes: a GPT-sized train state saved through orbax's
CheckpointManager (as `jaxdist.train.checkpoint.Checkpoints` does) with each writing option, side by
side with the raw write bandwidth of the same directory (the same bytes, fsync'd, from 1 and 8 threads).

Each option's row: `save()` (the blocking device-to-host copy), `write` (orbax's background writes,
fsync'd), `checksums` (reading the files back for their CRC-32, as `Checkpoints` does after each save)
and the bandwidth of write + checksums against the raw write of the same bytes.

    python bench/checkpoint_write.py --params 124e6 [--dir /dev/shm/x] [--saves 3]
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from jaxdist.train import checkpoint as checkpoint_lib  # noqa: E402


def gpt_like_state(params: float, leaves: int = 48) -> dict:
    """Parameters and two moments of `params` float32 values in `leaves` arrays on the first device."""
    size = int(params) // leaves
    make = jax.jit(lambda i: jnp.full((size,), i, jnp.float32), static_argnums=0)
    return {part: {f"w{i}": make(i) for i in range(leaves)} for part in ("params", "mu", "nu")}


def raw_write(directory: Path, arrays: list[np.ndarray], threads: int) -> float:
    """Seconds to write `arrays` (split into `threads` files of about equal size) and fsync them."""
    directory.mkdir(parents=True, exist_ok=True)
    pieces = [piece for a in arrays for piece in _pieces(memoryview(a).cast("B"), 64 << 20)]
    share = -(-sum(len(piece) for piece in pieces) // threads)
    parts, size = [[]], 0
    for piece in pieces:  # runs of pieces of about `share` bytes, one file (and thread) each
        if size >= share:
            parts, size = [*parts, []], 0
        parts[-1].append(piece)
        size += len(piece)

    def write(i):
        with open(directory / f"part{i}", "wb", buffering=0) as f:
            for piece in parts[i]:
                f.write(piece)
            os.fsync(f.fileno())

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(write, range(len(parts))))
    fd = os.open(directory, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    seconds = time.perf_counter() - start
    shutil.rmtree(directory)
    return seconds


def _pieces(view: memoryview, size: int):
    return [view[i : i + size] for i in range(0, len(view), size)]


VARIANTS = {
    "ocdbt (orbax default)": dict(handler={}, args={}),
    "ocdbt, zarr3, 64 MiB data files": dict(
        handler={"use_zarr3": True}, args={"ocdbt_target_data_file_size": 64 << 20}
    ),
    "no ocdbt (a zarr array per leaf)": dict(handler={"use_ocdbt": False}, args={}),
}


def time_variant(state, directory: Path, variant: dict, saves: int) -> dict[str, list[float]]:
    handlers = {
        "state": ocp.PyTreeCheckpointHandler(use_compression=False, **variant["handler"]),
        "meta": ocp.JsonCheckpointHandler(),
    }
    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True, enable_async_checkpointing=True)
    manager = ocp.CheckpointManager(directory, options=options, item_handlers=handlers)
    times = {"save()": [], "write": [], "checksums": []}
    try:
        for step in range(saves + 1):  # the first save warms up
            start = time.perf_counter()
            args = ocp.args.Composite(
                state=ocp.args.PyTreeSave(state, **variant["args"]), meta=ocp.args.JsonSave({"step": step})
            )
            manager.save(step, args=args, force=True)
            returned = time.perf_counter()
            manager.wait_until_finished()
            written = time.perf_counter()
            checkpoint_lib._file_sums(directory / str(step))
            if step:
                times["save()"].append(returned - start)
                times["write"].append(written - returned)
                times["checksums"].append(time.perf_counter() - written)
    finally:
        manager.close()
        shutil.rmtree(directory, ignore_errors=True)
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=124e6, help="model parameters (the state is 3x, float32)")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args()
    state = gpt_like_state(args.params)
    jax.block_until_ready(state)
    host = [np.asarray(x) for x in jax.tree.leaves(state)]
    gib = sum(a.nbytes for a in host) / 2**30
    base = Path(args.dir or tempfile.mkdtemp(prefix="jaxdist-ckpt-write-"))
    raw = {t: statistics.median(raw_write(base / f"raw{t}", host, t) for _ in range(3)) for t in (1, 8)}
    print(
        f"| raw write, {gib:.2f} GiB, fsync | 1 thread {gib / raw[1]:.2f} GiB/s | 8 threads {gib / raw[8]:.2f} GiB/s |"
    )
    print("| orbax writes | save() s | write s | checksums s | GiB/s (write + checksums) | vs raw 8 threads |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, variant in VARIANTS.items():
        med = {k: statistics.median(v) for k, v in time_variant(state, base / "orbax", variant, args.saves).items()}
        rate = gib / (med["write"] + med["checksums"])
        cells = [f"{med[k]:.3f}" for k in ("save()", "write", "checksums")] + [
            f"{rate:.2f}",
            f"{rate * raw[8] / gib:.2f}",
        ]
        print(f"| {name} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
