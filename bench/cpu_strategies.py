"""jaxdist's strategies against XLA's automatic sharding of the same model, on 8 simulated CPU devices.

Same GPT, same global batch, same optimizer (Adam): step time (median over
reps after warm-up, interleaved) and peak temp memory from
`compiled.memory_analysis()`. DDP, ZeRO-1 and DP x TP are compared with XLA's
automatic data parallelism (replicated parameters, batch split), FSDP with
XLA's automatic FSDP (parameters split along their largest dimension). Prints a
table last and appends it to bench/RESULTS.md.

    python bench/cpu_strategies.py [--reps 20] [--layers 4]
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from results import append_result  # noqa: E402
from xla_auto import AutoShardedRun  # noqa: E402

from jaxdist.ddp.run import DDP  # noqa: E402
from jaxdist.engine.fsdp import FSDP, Units  # noqa: E402
from jaxdist.engine.run import Parallel  # noqa: E402
from jaxdist.models.gpt import FLAVORS, GPT, UNITS, embed_inputs, head_loss, next_token_loss, tp_plan_for  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    cfg = dataclasses.replace(FLAVORS["small-cpu"], n_layers=args.layers)
    devices = jax.devices("cpu")[:8]
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1)).astype(np.int32)}

    def model():
        return GPT(cfg, nnx.Rngs(0))

    def opt():
        return optax.adam(1e-3)

    dp = jax.make_mesh((8,), ("dp",), devices=devices)
    fsdp = jax.make_mesh((8,), ("fsdp",), devices=devices)
    dptp = jax.make_mesh((2, 4), ("dp", "tp"), devices=devices)
    runs = {
        "xla auto DP": AutoShardedRun(dp, model(), opt(), next_token_loss, batch_axes=("dp",), shard_axis=None),
        "xla auto FSDP": AutoShardedRun(fsdp, model(), opt(), next_token_loss, batch_axes=("fsdp",), shard_axis="fsdp"),
        "jaxdist DDP": DDP(dp, zero1=False, bucket_size=100_000).prepare(model(), opt(), next_token_loss, batch),
        "jaxdist ZeRO-1": DDP(dp, zero1=True, bucket_size=100_000).prepare(model(), opt(), next_token_loss, batch),
        "jaxdist FSDP": FSDP(fsdp).prepare(model(), opt(), Units(embed_inputs, head_loss), batch),
        "jaxdist DP x TP (2x4)": Parallel(dptp, plan=tp_plan_for(cfg)).prepare(model(), opt(), UNITS, batch),
    }
    baseline = {
        "jaxdist DDP": "xla auto DP",
        "jaxdist ZeRO-1": "xla auto DP",
        "jaxdist DP x TP (2x4)": "xla auto DP",
        "jaxdist FSDP": "xla auto FSDP",
    }
    temp, states, times = {}, {}, {name: [] for name in runs}
    for name, run in runs.items():
        temp[name] = run.step.lower(run.state, batch).compile().memory_analysis().temp_size_in_bytes
        state = run.state
        for _ in range(3):
            state, _ = run.step(state, batch)
        states[name] = jax.block_until_ready(state)
    for _ in range(args.reps):  # interleaved: drift hits every run alike
        for name, run in runs.items():
            t0 = time.perf_counter()
            states[name], _ = run.step(states[name], batch)
            jax.block_until_ready(states[name])
            times[name].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    lines = [
        f"GPT {cfg.num_params() / 1e6:.2f}M ({args.layers} layers, d={cfg.d_model}, T={cfg.seq_len}), "
        f"batch {args.batch}, Adam, {args.reps} interleaved reps, jax {jax.__version__}, 8 CPU devices",
        "",
        "| run | ms/step | vs XLA auto | temp MB | vs XLA auto |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in runs:
        base = baseline.get(name)
        t_ratio = f"{med[name] / med[base]:.2f}x" if base else "-"
        m_ratio = f"{temp[name] / temp[base]:.2f}x" if base else "-"
        lines.append(f"| {name} | {1e3 * med[name]:.1f} | {t_ratio} | {temp[name] / 1e6:.2f} | {m_ratio} |")
    table = "\n".join(lines)
    print("\n" + table)
    append_result(
        "CPU strategies vs XLA automatic sharding",
        "python bench/cpu_strategies.py " + " ".join(sys.argv[1:]),
        "8 simulated CPU devices",
        table,
    )


if __name__ == "__main__":
    main()
