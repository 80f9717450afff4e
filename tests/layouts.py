"""The layouts checkpoints convert between, over the 8 simulated CPU devices, on a tiny GPT."""

import numpy as np
from meshes import cpu_mesh

from jaxdist.ddp import DDP
from jaxdist.engine import Parallel
from jaxdist.train.gpt import GPT, UNITS, GPTConfig, next_token_loss, tp_plan_for

GPT_CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
PLAN = tp_plan_for(GPT_CFG)

# name -> a function (model, optimizer, example batch) -> a prepared run
LAYOUTS = {
    "ddp8": lambda m, o, b: DDP(cpu_mesh((8,), ("dp",))).prepare(m, o, next_token_loss, b),
    "zero1-8": lambda m, o, b: DDP(cpu_mesh((8,), ("dp",)), zero1=True).prepare(m, o, next_token_loss, b),
    "engine-dp8": lambda m, o, b: Parallel(cpu_mesh((8,), ("dp",)), zero1=False).prepare(m, o, UNITS, b),
    "engine-zero1-8": lambda m, o, b: Parallel(cpu_mesh((8,), ("dp",))).prepare(m, o, UNITS, b),
    "fsdp8": lambda m, o, b: Parallel(cpu_mesh((8,), ("fsdp",))).prepare(m, o, UNITS, b),
    "hsdp2x4": lambda m, o, b: Parallel(cpu_mesh((2, 4), ("dp", "fsdp"))).prepare(m, o, UNITS, b),
    "dp4xtp2": lambda m, o, b: Parallel(cpu_mesh((4, 2), ("dp", "tp")), plan=PLAN).prepare(m, o, UNITS, b),
    "fsdp-tp2x2x2": lambda m, o, b: Parallel(cpu_mesh((2, 2, 2), ("dp", "fsdp", "tp")), plan=PLAN).prepare(
        m, o, UNITS, b
    ),
    "one": lambda m, o, b: DDP(cpu_mesh((1,), ("dp",))).prepare(m, o, next_token_loss, b),
}


def make_model(seed: int = 0) -> GPT:
    from flax import nnx

    return GPT(GPT_CFG, nnx.Rngs(seed))


def batches(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, 64, (16, 17)).astype(np.int32)} for _ in range(n)]
