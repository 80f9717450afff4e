"""A bfloat16 compute copy of the parameters carried in the train state, against casting per use.

    python bench/compute_copy_ab.py --flavor 1.3b:8 --flavor 350m:16 --repeat 2

With float32 parameters and bfloat16 compute, every step casts each kernel and embedding to bfloat16
in the forward (~2 ms of GPT-1.3B's step, reading 4 bytes and writing 2 per parameter). Megatron-LM
keeps instead a bfloat16 copy of the parameters beside its float32 main copy, written by the optimizer
update. Both variants here are a plain `jit` of value_and_grad and optax (global-norm clip, AdamW),
state donated, one process each, alternating:

* `cast`: the state is (float32 parameters, optimizer state); the model casts per use.
* `copy`: the state also holds a bfloat16 copy of every parameter of two or more dimensions (the
  kernels and embeddings, which the GPT only ever reads cast to bfloat16); the gradient is taken with
  respect to the copy, the update of the float32 parameters writes the next copy.

Prints ms/step (the median of three windows of `--steps` steps), peak GiB and the first five losses
per configuration. On the CPU (`JAX_PLATFORMS=cpu`) a tiny GPT checks the script, nothing more.
"""

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

RESULT = "COMPUTE_COPY "


def child(flavor: str, batch_size: int, variant: str, steps: int) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from jaxdist.models.gpt import FLAVORS, GPT, next_token_loss

    cpu = jax.devices()[0].platform == "cpu"
    cfg = dataclasses.replace(FLAVORS[flavor], dtype=jnp.bfloat16, attention=None if cpu else "cudnn")
    if cpu:
        cfg = dataclasses.replace(cfg, n_layers=2, d_model=128, n_heads=4, seq_len=64, vocab_size=512)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), dtype=np.int32)
    batch = {"tokens": jnp.asarray(tokens)}
    with jax.default_device(jax.devices("cpu")[0]):
        model = GPT(cfg, nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    params = jax.device_put(nnx.to_pure_dict(params), jax.devices()[0])
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.1))

    def loss_of(p, batch):
        return next_token_loss(nnx.merge(graphdef, nnx.State(p)), batch)

    def copied(x) -> bool:  # kernels and embeddings: the GPT reads them only cast to bfloat16
        return x.ndim >= 2

    def compute_copy(p):
        return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if copied(x) else None, p)

    def merge(copy, p):  # the copy where there is one, else the float32 parameter
        return jax.tree.map(lambda c, x: x if c is None else c, copy, p, is_leaf=lambda c: c is None)

    def cast_step(state, batch):
        p, opt_state = state
        loss, grads = jax.value_and_grad(loss_of)(p, batch)
        updates, opt_state = optimizer.update(grads, opt_state, p)
        return (optax.apply_updates(p, updates), opt_state), loss

    def copy_step(state, batch):
        p, opt_state, copy = state
        rest = jax.tree.map(lambda x: None if copied(x) else x, p)
        loss, (g_copy, g_rest) = jax.value_and_grad(lambda c, r: loss_of(merge(c, r), batch), (0, 1))(copy, rest)
        updates, opt_state = optimizer.update(merge(g_copy, g_rest), opt_state, p)
        p = optax.apply_updates(p, updates)
        return (p, opt_state, compute_copy(p)), loss

    state = (params, optimizer.init(params))
    if variant == "copy":
        state = (*state, jax.jit(compute_copy)(params))
    step = jax.jit(cast_step if variant == "cast" else copy_step, donate_argnums=0)
    losses = []
    for _ in range(5):
        state, loss = step(state, batch)
        losses.append(float(loss))
    windows = []
    for _ in range(3):
        jax.block_until_ready(state)
        start = time.perf_counter()
        for _ in range(steps):
            state, loss = step(state, batch)
        jax.block_until_ready(state)
        windows.append((time.perf_counter() - start) / steps)
    stats = jax.devices()[0].memory_stats() or {}
    out = {"ms": 1e3 * statistics.median(windows), "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30}
    print(RESULT + json.dumps({**out, "losses": losses}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", action="append", help="FLAVOR:BATCH, e.g. 1.3b:8 (repeatable)")
    parser.add_argument("--repeat", type=int, default=1, help="cast/copy pairs per flavor, alternating")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--child", nargs=3, metavar=("FLAVOR", "BATCH", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.child[2], args.steps)
        return
    rows = ["| flavor x batch | variant | ms/step | peak GiB | losses of steps 1-5 |", "|" + " --- |" * 5]
    for spec in args.flavor or ["1.3b:8", "350m:16"]:
        flavor, batch = spec.split(":")
        for _ in range(args.repeat):
            for variant in ("cast", "copy"):
                cmd = [sys.executable, __file__, "--child", flavor, batch, variant, "--steps", str(args.steps)]
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
                if not lines:
                    rows.append(f"| {flavor} x {batch} | {variant} | failed: {proc.stderr.strip()[-200:]} | | |")
                    continue
                r = json.loads(lines[-1][len(RESULT) :])
                losses = ", ".join(f"{x:.5f}" for x in r["losses"])
                rows.append(f"| {flavor} x {batch} | {variant} | {r['ms']:.2f} | {r['peak_gib']:.2f} | {losses} |")
                print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
