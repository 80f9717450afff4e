"""Train a tiny GPT with DDP or ZeRO-1 on every device (8 simulated CPU devices without GPUs).

python examples/ddp_gpt.py            # ZeRO-1
python examples/ddp_gpt.py --plain    # plain DDP (replicated optimizer state)
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxdist.ddp.run import DDP  # noqa: E402
from jaxdist.models.gpt import GPT, GPTConfig, next_token_loss  # noqa: E402


def main() -> None:
    devices = jax.devices() if len(jax.devices()) >= 2 else jax.devices("cpu")
    mesh = jax.make_mesh((len(devices),), ("dp",), devices=devices)
    cfg = GPTConfig(vocab_size=32, seq_len=32, d_model=64, n_heads=4, n_layers=2)
    # a learnable stream: each sequence counts up from a random start, modulo the vocabulary
    rng = np.random.default_rng(0)

    def batch():
        start = rng.integers(0, cfg.vocab_size, (16, 1))
        return {"tokens": ((start + np.arange(cfg.seq_len + 1)) % cfg.vocab_size).astype(np.int32)}

    ddp = DDP(mesh, zero1="--plain" not in sys.argv, bucket_size=20_000)
    run = ddp.prepare(GPT(cfg, nnx.Rngs(0)), optax.adamw(3e-3), next_token_loss, batch())
    print(run.layout, "\n")
    state = run.state
    for step in range(30):
        state, metrics = run.step(state, batch())
        if step % 5 == 0 or step == 29:
            print(f"step {step:3d}  loss {float(metrics['loss']):.4f}  grad norm {float(metrics['grad_norm']):.3f}")


if __name__ == "__main__":
    main()
