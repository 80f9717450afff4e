"""Where one GPU's step time goes, per kind of op (matmuls, attention, fusions, copies), for a GPT
flavor under one strategy of bench/one_gpu.py, from a `jax.profiler` trace of a few steps.

    python bench/step_profile.py --flavor 1.3b --batch 8                 # the plain jit baseline
    python bench/step_profile.py --flavor 350m --batch 16 --strategy "trainer default"
"""

import argparse
import os
import sys
import tempfile

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")

import jax  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from one_gpu import STRATEGIES, warmed_gpt_step  # noqa: E402
from op_profile import summarize  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="350m")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--strategy", default="plain jit", choices=STRATEGIES)
    p.add_argument("--steps", type=int, default=5, help="traced steps")
    p.add_argument("--top", type=int, default=25, help="most expensive single ops listed")
    args = p.parse_args()
    run, state, batch, cfg = warmed_gpt_step(args.flavor, args.batch, args.strategy)
    with tempfile.TemporaryDirectory() as trace:
        with jax.profiler.trace(trace):
            for _ in range(args.steps):
                state, _ = run.step(state, batch)
            jax.block_until_ready(state)
        print(f"GPT-{args.flavor}, {args.batch} x {cfg.seq_len}, {args.strategy}")
        print(summarize(trace, args.steps, args.top))


if __name__ == "__main__":
    main()
