"""Where one GPU's step time goes, per kind of op (matmuls, attention, fusions, copies), for a GPT
flavor under one strategy of bench/one_gpu.py, from a `jax.profiler` trace of a few steps.

    python bench/step_profile.py --flavor 1.3b --batch 8                 # the plain jit baseline
    python bench/step_profile.py --flavor 350m --batch 16 --strategy "trainer default"
"""

import argparse
import dataclasses
import os
import sys
import tempfile

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from one_gpu import STRATEGIES, build  # noqa: E402
from op_profile import summarize  # noqa: E402

from jaxdist.models.gpt import FLAVORS, GPT  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="350m")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--strategy", default="plain jit", choices=STRATEGIES)
    p.add_argument("--steps", type=int, default=5, help="traced steps")
    p.add_argument("--top", type=int, default=25, help="most expensive single ops listed")
    args = p.parse_args()
    cfg = dataclasses.replace(
        FLAVORS[args.flavor], dtype=jnp.bfloat16, attention="cudnn" if jax.default_backend() == "gpu" else None
    )
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), dtype=np.int32)
    batch = {"tokens": jnp.asarray(tokens)}
    with jax.default_device(jax.devices("cpu")[0]):
        model = GPT(cfg, nnx.Rngs(0))
    run = build(args.strategy, model, batch, args.flavor, False)
    state = run.state
    for _ in range(3):  # compile and warm up
        state, _ = run.step(state, batch)
    jax.block_until_ready(state)
    with tempfile.TemporaryDirectory() as trace:
        with jax.profiler.trace(trace):
            for _ in range(args.steps):
                state, _ = run.step(state, batch)
            jax.block_until_ready(state)
        print(f"GPT-{args.flavor}, {args.batch} x {cfg.seq_len}, {args.strategy}")
        print(summarize(trace, args.steps, args.top))


if __name__ == "__main__":
    main()
