"""Train a GPT with FSDP (ZeRO-3, double buffered) on every device (8 simulated CPU devices without GPUs).

python examples/fsdp_gpt.py                       # FSDP over all devices
python examples/fsdp_gpt.py --update-in-backward  # update each block as soon as its gradients arrive
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxdist.engine.fsdp import FSDP, Units  # noqa: E402
from jaxdist.models.gpt import GPT, GPTConfig, embed_inputs, head_loss  # noqa: E402


def main() -> None:
    devices = jax.devices() if len(jax.devices()) >= 2 else jax.devices("cpu")
    mesh = jax.make_mesh((len(devices),), ("fsdp",), devices=devices)
    cfg = GPTConfig(vocab_size=32, seq_len=32, d_model=64, n_heads=4, n_layers=4)
    rng = np.random.default_rng(0)

    def batch():  # each sequence counts up from a random start: learnable, so the loss falls
        start = rng.integers(0, cfg.vocab_size, (16, 1))
        return {"tokens": ((start + np.arange(cfg.seq_len + 1)) % cfg.vocab_size).astype(np.int32)}

    in_backward = "--update-in-backward" in sys.argv
    fsdp = FSDP(mesh, buffers=2, update_in_backward=in_backward)
    run = fsdp.prepare(GPT(cfg, nnx.Rngs(0)), optax.adamw(3e-3), Units(embed_inputs, head_loss), batch())
    qkv = run.state.params["blocks"][0]["qkv"]["kernel"]  # each parameter in its own shape, sharded
    block = sum(x.size for x in jax.tree.leaves(run.state.params["blocks"][0]))
    print(
        f"{run.n_blocks} blocks of {block} parameters; qkv kernel {qkv.shape}: {qkv.sharding.spec} over {mesh.shape}\n"
    )
    state = run.state
    for step in range(30):
        state, metrics = run.step(state, batch())
        if step % 5 == 0 or step == 29:
            print(f"step {step:3d}  loss {float(metrics['loss']):.4f}")


if __name__ == "__main__":
    main()
