"""What cuBLAS sustains on one GPU when it runs matmuls back to back for seconds, as a training step does,
rather than for the few calls a kernel benchmark times: the TFLOP/s of each window beside the SM clock and
power draw sampled in it. Where power reaches the card's limit the clock falls, and the matmuls with it.

    python bench/sustained_matmul.py --flavor 1.3b --batch 8 --seconds 12

The matmul is the flavor's MLP input projection (tokens x d_model by d_model x 4 d_model), bfloat16 with
random operands (a constant operand draws less power: fewer bits toggle in the tensor cores).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_clock import ClockSampler  # noqa: E402

from jaxdist.models.gpt import FLAVORS  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="1.3b", choices=sorted(FLAVORS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--window", type=int, default=200, help="calls per timed window")
    args = p.parse_args()
    cfg = FLAVORS[args.flavor]
    m, k, n = args.batch * cfg.seq_len, cfg.d_model, cfg.ff
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (k, n), jnp.bfloat16) * k**-0.5
    matmul = jax.jit(lambda x, w: x @ w)
    matmul(x, w).block_until_ready()
    windows, begin = [], time.perf_counter()
    with ClockSampler() as clocks:
        while time.perf_counter() - begin < args.seconds:
            start = time.perf_counter()
            for _ in range(args.window):
                y = matmul(x, w)
            y.block_until_ready()
            windows.append((start - begin, time.perf_counter() - start))
    flops = 2 * m * k * n * args.window
    print(f"GPT-{args.flavor} fc1, {m} x {k} x {n} bfloat16, {args.window} calls per window, back to back:")
    every = max(1, len(windows) // 12)
    for at, seconds in windows[::every]:
        print(f"  t={at:5.2f} s  {flops / seconds / 1e12:6.0f} TFLOP/s")
    first, last = windows[0][1], statistics.median(s for _, s in windows[len(windows) // 2 :])
    print(f"first window {flops / first / 1e12:.0f} TFLOP/s, second half's median {flops / last / 1e12:.0f} TFLOP/s")
    half = slice(len(clocks.samples) // 2, None)
    print(f"first second: {clocks.summary(slice(0, 10))}; second half: {clocks.summary(half)}")


if __name__ == "__main__":
    main()
