"""Multi-GPU validation and weak scaling of the strategies (needs 2+ GPUs).

For DDP, ZeRO-1, FSDP and DP x TP with both comm backends: train the GPT for
STEPS steps on all GPUs and compare every loss with a one-GPU run of the same
global batch; then time a step (median of reps after warm-up) with the global
batch growing with the GPU count (weak scaling), for 1..N GPUs. Prints tables last.

    python bench/multigpu.py [--steps 20]
"""

import argparse
import os
import sys
import time

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh

sys.path.insert(0, os.path.dirname(__file__))
from results import append_result  # noqa: E402

from jaxdist.comm import nccl  # noqa: E402
from jaxdist.ddp.run import DDP  # noqa: E402
from jaxdist.engine.fsdp import FSDP, Units  # noqa: E402
from jaxdist.engine.run import Parallel  # noqa: E402
from jaxdist.models.gpt import GPT, UNITS, GPTConfig, embed_inputs, head_loss, next_token_loss, tp_plan_for  # noqa: E402

CFG = GPTConfig(vocab_size=256, seq_len=128, d_model=256, n_heads=8, n_layers=4)


def batches(n, batch_size, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {"tokens": rng.integers(0, CFG.vocab_size, (batch_size, CFG.seq_len + 1)).astype(np.int32)} for _ in range(n)
    ]


def mesh_for(strategy, gpus):
    n = len(gpus)
    if strategy == "dp_tp":
        shape, names = ((n // 2, 2) if n > 1 else (1, 1)), ("dp", "tp")
    elif strategy == "fsdp":
        shape, names = (n,), ("fsdp",)
    else:
        shape, names = (n,), ("dp",)
    return Mesh(np.asarray(gpus).reshape(shape), names, axis_types=(AxisType.Explicit,) * len(names))


def prepare(strategy, mesh, backend, batch):
    model = GPT(CFG, nnx.Rngs(0))
    opt = optax.adam(1e-3)
    if backend == "nccl":
        nccl.init(mesh)
    if strategy == "ddp":
        return DDP(mesh, zero1=False, bucket_size=200_000, backend=backend).prepare(model, opt, next_token_loss, batch)
    if strategy == "zero1":
        return DDP(mesh, zero1=True, bucket_size=200_000, backend=backend).prepare(model, opt, next_token_loss, batch)
    if strategy == "fsdp":
        return FSDP(mesh, backend=backend).prepare(model, opt, Units(embed_inputs, head_loss), batch)
    return Parallel(mesh, plan=tp_plan_for(CFG), backend=backend).prepare(model, opt, UNITS, batch)


def train(run, data):
    state, losses = run.state, []
    for b in data:
        state, m = run.step(state, b)
        losses.append(float(m["loss"]))
    return losses


def step_time(run, batch, reps=10):
    state = run.state
    for _ in range(3):
        state, m = run.step(state, batch)
    jax.block_until_ready(state)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        state, m = run.step(state, batch)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--per-gpu-batch", type=int, default=8)
    args = ap.parse_args()
    gpus = jax.devices("gpu")
    n = len(gpus)
    strategies = ["ddp", "zero1", "fsdp", "dp_tp"]
    parity = []
    with jax.default_matmul_precision("highest"):
        data = batches(args.steps, args.per_gpu_batch * n)
        ref = train(prepare("ddp", mesh_for("ddp", gpus[:1]), "xla", data[0]), data)  # one GPU, whole batch
        for strategy in strategies:
            for backend in ("xla", "nccl"):
                losses = train(prepare(strategy, mesh_for(strategy, gpus), backend, data[0]), data)
                err = float(np.max(np.abs(np.asarray(losses) - ref) / np.asarray(ref)))
                parity.append((strategy, backend, n, losses[0], losses[-1], err))
    scaling = []
    for strategy in strategies:
        for backend in ("xla", "nccl"):
            for k in sorted({1, 2, n} & set(range(1, n + 1))):
                if strategy == "dp_tp" and k == 1:
                    continue
                batch = batches(1, args.per_gpu_batch * k)[0]
                t = step_time(prepare(strategy, mesh_for(strategy, gpus[:k]), backend, batch), batch)
                scaling.append((strategy, backend, k, t))
    out = [f"{n} x {gpus[0].device_kind}, jax {jax.__version__}, GPT {CFG.num_params() / 1e6:.1f}M params", "```"]
    out.append(f"parity over {args.steps} Adam steps vs 1 GPU (same global batch {args.per_gpu_batch * n}):")
    out.append(f"{'strategy':10} {'backend':8} {'gpus':>4} {'loss[0]':>9} {'loss[-1]':>9} {'max rel diff':>13}")
    out += [f"{s:10} {b:8} {k:>4} {f:>9.5f} {la:>9.5f} {e:>13.2e}" for s, b, k, f, la, e in parity]
    out.append(f"weak scaling: step time, {args.per_gpu_batch} sequences of {CFG.seq_len} per GPU:")
    out.append(f"{'strategy':10} {'backend':8} {'gpus':>4} {'ms/step':>9} {'efficiency':>11}")
    base = {}
    for s, b, k, t in scaling:
        base.setdefault((s, b), t)
        out.append(f"{s:10} {b:8} {k:>4} {1e3 * t:>9.2f} {base[(s, b)] / t:>11.2f}")
    table = "\n".join([*out, "```"])
    print("\n" + table)
    command = "python bench/multigpu.py " + " ".join(sys.argv[1:])
    append_result("Multi-GPU parity and weak scaling", command, f"{n} x {gpus[0].device_kind}", table)


if __name__ == "__main__":
    main()
