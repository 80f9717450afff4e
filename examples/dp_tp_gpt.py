"""Train a GPT with tensor parallelism x data parallelism (8 simulated CPU devices without GPUs).

The GPT's own forward runs on each rank's pieces: its TP plan (jaxdist.models.gpt.TP_PLAN) says
which layers split how, and the unit engine binds the parallel layers in their place.

python examples/dp_tp_gpt.py            # dp=2 x tp=4, ZeRO-1 over dp
python examples/dp_tp_gpt.py --seqpar   # with sequence parallelism
python examples/dp_tp_gpt.py --fsdp     # fsdp=2 x tp=4 (parameters re-gathered for backward)
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxdist.engine.run import Parallel  # noqa: E402
from jaxdist.models.gpt import GPT, UNITS, GPTConfig, tp_plan_for  # noqa: E402


def main() -> None:
    devices = jax.devices() if len(jax.devices()) >= 2 else jax.devices("cpu")
    tp = 4 if len(devices) % 4 == 0 else 1
    data_axis = "fsdp" if "--fsdp" in sys.argv else "dp"
    mesh = jax.make_mesh((len(devices) // tp, tp), (data_axis, "tp"), devices=devices)
    cfg = GPTConfig(vocab_size=32, seq_len=32, d_model=64, n_heads=4, n_layers=2)
    rng = np.random.default_rng(0)

    def batch():  # each sequence counts up from a random start: learnable, so the loss falls
        start = rng.integers(0, cfg.vocab_size, (16, 1))
        return {"tokens": ((start + np.arange(cfg.seq_len + 1)) % cfg.vocab_size).astype(np.int32)}

    parallel = Parallel(mesh, plan=tp_plan_for(cfg), sequence_parallel="--seqpar" in sys.argv and tp > 1)
    run = parallel.prepare(GPT(cfg, nnx.Rngs(0)), optax.adamw(3e-3), UNITS, batch())
    print(f"mesh {dict(mesh.shape)}: each block's weights split over tp, each piece sharded over {data_axis}\n")
    state = run.state
    for step in range(30):
        state, metrics = run.step(state, batch())
        if step % 5 == 0 or step == 29:
            print(f"step {step:3d}  loss {float(metrics['loss']):.4f}")


if __name__ == "__main__":
    main()
