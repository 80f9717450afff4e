"""What a checkpoint's host copy costs a compute-bound step loop, by how the state is copied.

    python bench/host_copy_cost.py [--every 10] [--steps 200] [--rounds 3]

A jitted step (a chain of bf16 matmuls, ~34 ms on an H200, and an update of every leaf of a 1.39 GiB
float32 state of 447 leaves, as a GPT-124M's AdamW state, donated) runs `--steps` times; every `--every`
steps the state is converted (a device copy, standing in for the canonical conversion) and copied into
host memory, and a background thread waits for the copy, as `jaxdist.train.checkpoint` does:

* none: no copies (the reference);
* device copy only: the conversion, no transfer;
* one transfer per array: `start_host_copy(tree)` (one `device_put` of the 447 arrays);
* packed, one transfer: `start_host_copy(tree, pack=True)` with the whole state as one run;
* packed in runs: `start_host_copy(tree, pack=True)` as saves make it (runs of `PACK_CHUNK_BYTES`, a
  transfer each).

Per mode: ms/step of each round (the modes interleaved round by round) and the median's ratio to none.
On a CPU the state is 64 MiB and the matmuls small (the script's check, not a measurement).
"""

import argparse
import statistics
import threading
import time

import jax
import jax.numpy as jnp

from jaxdist.train import host_copy
from jaxdist.train.host_copy import start_host_copy, wait_for_host_copy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--every", type=int, default=10, help="a copy every this many steps")
    p.add_argument("--steps", type=int, default=200, help="steps per mode and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--matmuls", type=int, default=20, help="8192 x 8192 bf16 matmuls per step (GPU)")
    args = p.parse_args()

    on_gpu = jax.devices()[0].platform == "gpu"
    leaf = int((1.39 * 2**30 if on_gpu else 64 * 2**20) / 4 / 447)
    state = [jnp.full((leaf,), i * 1e-3, jnp.float32) for i in range(447)]
    width = 8192 if on_gpu else 256
    weight = jax.random.normal(jax.random.key(0), (width, width), jnp.bfloat16) / width**0.5
    x0 = jax.random.normal(jax.random.key(1), (width, width), jnp.bfloat16)
    matmuls = args.matmuls if on_gpu else 2

    def step(state, x):
        for _ in range(matmuls):
            x = jnp.tanh(x @ weight)
        return [a * 0.9999 for a in state], x

    step = jax.jit(step, donate_argnums=(0,))

    @jax.jit
    def convert(state):  # new buffers, as the canonical conversion's outputs are
        return [a + 0 for a in state]

    def packed_as_one(state):
        runs, host_copy.PACK_CHUNK_BYTES = host_copy.PACK_CHUNK_BYTES, 1 << 62
        try:
            return start_host_copy(state, pack=True)
        finally:
            host_copy.PACK_CHUNK_BYTES = runs

    modes = {  # name: (what a save enqueues, what its background thread waits for it with)
        "none": None,
        "device copy only": (convert, jax.block_until_ready),
        "one transfer per array": (lambda s: start_host_copy(convert(s)), wait_for_host_copy),
        "packed, one transfer": (lambda s: packed_as_one(convert(s)), wait_for_host_copy),
        "packed in runs": (lambda s: start_host_copy(convert(s), pack=True), wait_for_host_copy),
    }

    def run(mode, state):
        x = x0
        state, x = step(state, x)
        jax.block_until_ready(x)
        waiter = None
        began = time.perf_counter()
        for i in range(args.steps):
            state, x = step(state, x)
            if modes[mode] is not None and (i + 1) % args.every == 0:
                if waiter is not None:
                    waiter.join()
                start, wait = modes[mode]
                waiter = threading.Thread(target=wait, args=(start(state),))
                waiter.start()
        jax.block_until_ready((state, x))
        if waiter is not None:
            waiter.join()
        return (time.perf_counter() - began) / args.steps * 1e3, state

    for mode in modes:  # compile every path, and take the pinned host memory once
        _, state = run(mode, state)
    times = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:
            ms, state = run(mode, state)
            times[mode].append(ms)
    base = statistics.median(times["none"])
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: a copy of 447 arrays every {args.every} steps\n")
    print("| copies | ms/step (each round) | time vs none |")
    print("| --- | --- | --- |")
    for mode, ms in times.items():
        print(f"| {mode} | {', '.join(f'{t:.2f}' for t in ms)} | {statistics.median(ms) / base:.4f} |")


if __name__ == "__main__":
    main()
