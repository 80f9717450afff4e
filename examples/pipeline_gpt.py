"""Train a GPT with pipeline parallelism x data parallelism x tensor parallelism (8 simulated CPU
devices without GPUs): pp=2 stages, dp=2, tp=2.

The GPT's blocks split into pp x virtual stages; each data rank's batch into micro-batches that
move through the stages as the schedule table says (printed first).

python examples/pipeline_gpt.py                         # 1F1B, 4 micro-batches
python examples/pipeline_gpt.py interleaved             # interleaved 1F1B, 2 stages per rank
python examples/pipeline_gpt.py gpipe
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxdist.models.gpt import GPT, UNITS, GPTConfig, tp_plan_for  # noqa: E402
from jaxdist.pipeline.run import Pipelined  # noqa: E402


def main() -> None:
    schedule = sys.argv[1] if len(sys.argv) > 1 else "1f1b"
    devices = jax.devices() if len(jax.devices()) >= 8 else jax.devices("cpu")[:8]
    mesh = jax.make_mesh((2, 2, 2), ("pp", "dp", "tp"), devices=devices)
    cfg = GPTConfig(vocab_size=32, seq_len=32, d_model=64, n_heads=4, n_layers=4)
    rng = np.random.default_rng(0)

    def batch():  # each sequence counts up from a random start: learnable, so the loss falls
        start = rng.integers(0, cfg.vocab_size, (16, 1))
        return {"tokens": ((start + np.arange(cfg.seq_len + 1)) % cfg.vocab_size).astype(np.int32)}

    virtual = 2 if schedule == "interleaved" else 1
    pipeline = Pipelined(mesh, plan=tp_plan_for(cfg), microbatches=4, schedule=schedule, virtual=virtual)
    print(pipeline.table(), "\n")
    run = pipeline.prepare(GPT(cfg, nnx.Rngs(0)), optax.adamw(3e-3), UNITS, batch())
    state = run.state
    for step in range(30):
        state, metrics = run.step(state, batch())
        if step % 5 == 0 or step == 29:
            print(f"step {step:3d}  loss {float(metrics['loss']):.4f}")


if __name__ == "__main__":
    main()
