"""GPT training throughput on one GPU: a plain Flax NNX + optax loop vs jaxdist, side by side.

Variants, all bf16 compute with float32 parameters, AdamW, batch x 1024 tokens:
  plain          the loop a user writes: nnx.Optimizer, nnx.value_and_grad, nnx.jit
  plain+cudnn    the same loop with cuDNN flash attention
  jaxdist        jaxdist's DDP strategy on a one-GPU mesh, with cuDNN flash attention
                 (what `jaxdist train` runs on one device)
tokens/s is measured over `--steps` steps after 3 warm-up steps; MFU = tokens/s x
(6 N + 12 L d T) / peak, with the datasheet dense bf16 peak of the device (989
TFLOP/s for the H100 and H200). Prints a table last and appends
it to bench/RESULTS.md.

    python bench/gpu_gpt.py [--flavors 124m 350m] [--batch 16] [--steps 20]
"""

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(__file__))
from results import append_result  # noqa: E402

from jaxdist.ddp.run import DDP  # noqa: E402
from jaxdist.models.gpt import FLAVORS, GPT, next_token_loss  # noqa: E402
from jaxdist.train.trainer import PEAK_FLOPS, flops_per_token  # noqa: E402


def plain_loop(cfg, batch, steps):
    model = GPT(cfg, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-4), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(next_token_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    for _ in range(3):
        step(model, optimizer, batch)
    jax.block_until_ready(nnx.state(model))
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step(model, optimizer, batch)
    jax.block_until_ready((loss, nnx.state(model)))
    return time.perf_counter() - t0


def jaxdist_loop(cfg, batch, steps):
    mesh = jax.make_mesh((1,), ("dp",), devices=jax.devices()[:1])
    run = DDP(mesh, zero1=False).prepare(GPT(cfg, nnx.Rngs(0)), optax.adamw(3e-4), next_token_loss, batch)
    state = run.state
    for _ in range(3):
        state, m = run.step(state, batch)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, m = run.step(state, batch)
    jax.block_until_ready(state)
    return time.perf_counter() - t0


def _time(f, *args, reps=20):
    out = f(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(reps):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


def breakdown(flavor: str, batch: int) -> str:
    """Where a block's time goes: attention (XLA's and cuDNN's) and the block's matmuls,
    each forward + backward at the model's shapes, per layer and times the layer count."""
    cfg = FLAVORS[flavor]
    b, t, h, d = batch, cfg.seq_len, cfg.n_heads, cfg.d_model
    key = jax.random.key(0)
    q = jax.random.normal(key, (b, t, h, d // h), jnp.bfloat16)

    def attention(impl):
        def f(q):
            return jax.nn.dot_product_attention(q, q, q, is_causal=True, implementation=impl).sum()

        return jax.jit(jax.grad(f))

    x = jax.random.normal(key, (b * t, d), jnp.bfloat16)
    ws = [jax.random.normal(key, s, jnp.bfloat16) * 0.02 for s in ((d, 3 * d), (d, d), (d, 4 * d), (4 * d, d))]

    def matmuls(ws, x):  # qkv, proj, fc, out: the block's dense layers
        y = (x @ ws[0])[:, :d] @ ws[1]
        return ((y @ ws[2]) @ ws[3]).astype(jnp.float32).sum()

    grad_mm = jax.jit(jax.grad(matmuls))
    rows = [
        ("attention, XLA", _time(attention("xla"), q)),
        ("attention, cuDNN flash", _time(attention("cudnn"), q)),
        ("block matmuls", _time(grad_mm, ws, x)),
    ]
    lines = [
        f"per-layer forward+backward at {flavor} (batch {b}, T={t}, d={d}, {h} heads); x {cfg.n_layers} layers:",
        "",
        "| part | ms per layer | ms per step (all layers) |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {name} | {1e3 * s:.2f} | {1e3 * s * cfg.n_layers:.1f} |" for name, s in rows]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--flavors", nargs="+", default=["124m", "350m"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--breakdown", action="store_true", help="time attention vs matmuls per layer instead")
    args = ap.parse_args()
    if args.breakdown:
        table = "\n\n".join(breakdown(f, args.batch) for f in args.flavors)
        print(table)
        device = jax.devices()[0].device_kind
        append_result("Where a GPT block's time goes", "python bench/gpu_gpt.py --breakdown", f"1 x {device}", table)
        return
    device = jax.devices()[0]
    peak = PEAK_FLOPS.get(device.device_kind)
    rows = []
    for flavor in args.flavors:
        base = dataclasses.replace(FLAVORS[flavor], dtype=jnp.bfloat16)
        rng = np.random.default_rng(0)
        batch = {"tokens": jnp.asarray(rng.integers(0, base.vocab_size, (args.batch, base.seq_len + 1)), jnp.int32)}
        tokens = args.batch * base.seq_len * args.steps
        for name, cfg, loop in (
            ("plain", base, plain_loop),
            ("plain+cudnn", dataclasses.replace(base, attention="cudnn"), plain_loop),
            ("jaxdist", dataclasses.replace(base, attention="cudnn"), jaxdist_loop),
        ):
            seconds = loop(cfg, batch, args.steps)
            tps = tokens / seconds
            mfu = tps * flops_per_token(cfg) / peak if peak else float("nan")
            rows.append((flavor, name, cfg.num_params() / 1e6, tps, mfu))
            print(rows[-1], flush=True)
    lines = [
        f"{device.device_kind}, jax {jax.__version__}, batch {args.batch} x 1024 tokens, bf16 compute, "
        f"float32 parameters, AdamW, {args.steps} timed steps; MFU = tokens/s x (6N + 12LdT) / {peak:.3g}",
        "",
        "| model | variant | params (M) | tokens/s | MFU | vs plain |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    plain = {f: tps for f, n, _, tps, _ in rows if n == "plain"}
    for flavor, name, params, tps, mfu in rows:
        lines.append(
            f"| {flavor} | {name} | {params:.0f} | {tps:,.0f} | {100 * mfu:.1f}% | {tps / plain[flavor]:.2f}x |"
        )
    table = "\n".join(lines)
    print("\n" + table)
    append_result(
        "GPT throughput on one GPU",
        "python bench/gpu_gpt.py " + " ".join(sys.argv[1:]),
        f"1 x {device.device_kind}",
        table,
    )


if __name__ == "__main__":
    main()
