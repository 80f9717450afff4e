"""Every strategy on all visible GPUs, one configuration per subprocess: speed, MFU, memory.

For each model (GPT-350M, GPT-1.3B: bf16 compute, float32 parameters, cuDNN
attention on GPU, AdamW) and each configuration in `CONFIGS` (a plain 1-GPU
jit, XLA's automatic DP and FSDP, and jaxdist's DDP, ZeRO-1, FSDP, the engine's ZeRO-3 (`zero3`:
recomputing each block in backward; `zero3keep`: keeping activations), DP x TP and
FSDP x TP with both comm backends), the parent re-runs this script with
`--one CONFIG` in a fresh process, so each configuration's peak memory is its
own and a crash, OOM or hang (`--timeout`) costs only its own row. The global
batch is `--per-gpu-batch` sequences per GPU (weak scaling), the same tokens
for every configuration on the same GPU count. After two warm-up steps (the first
compiles), `ms/step` is the time of `--steps` steps dispatched back to back (as the
trainer runs them: the host dispatches step i+1 while the GPUs run step i) over
`--steps`, the median of three such windows; `sync ms` is the median of as many steps each waited for before the next
is dispatched (the step's latency, host dispatch included), and `dispatch ms` the
median time until such a call returns (the host's dispatch, on idle devices).
tokens/s, MFU and the ratios come from `ms/step`.

Columns: tokens/s per GPU; MFU = tokens/s per GPU x (6N + 12 L d T) / the
datasheet dense bf16 peak (989 TFLOP/s on H100 and H200); peak memory per GPU
(`peak_bytes_in_use`, the largest over the configuration's GPUs); weak-scaling
efficiency = tokens/s per GPU / that of the 1-GPU plain jit; speed vs
`--baseline` = tokens/s per GPU / the baseline's; the loss after the last step
(same data and init, so configurations on the same GPU count agree to bf16
noise); startup = building the model and the strategy, compiling, the first
step. Prints each row as it finishes and a table last, appended to
bench/RESULTS.md.

    python bench/strategies.py [--models 350m,1.3b] [--configs 1gpu,xla-fsdp,fsdp-nccl] [--steps 10]
    python bench/strategies.py --cpu --models tiny --steps 2   # dry run, 8 simulated CPU devices, not recorded

`JAXDIST_BENCH_NCCL_BLOCKING=0` makes the nccl configurations' communicators non-blocking.
`JAXDIST_BENCH_BUCKET_SIZE=N` sets DDP's bucket size in elements (default 10M).
`JAXDIST_BENCH_MICROBATCHES=M` sets the pipeline configurations' micro-batches per step (default 4 pp).
"""

import os
import sys

if "--cpu" in sys.argv:  # before JAX starts
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from results import append_result, run_child  # noqa: E402
from xla_auto import AutoShardedRun  # noqa: E402

from jaxdist.comm import nccl  # noqa: E402
from jaxdist.ddp.buckets import DEFAULT_BUCKET_SIZE  # noqa: E402
from jaxdist.ddp.run import DDP  # noqa: E402
from jaxdist.engine.fsdp import FSDP, Units  # noqa: E402
from jaxdist.engine.run import Parallel  # noqa: E402
from jaxdist.models.gpt import FLAVORS, GPT, UNITS, embed_inputs, head_loss, next_token_loss, tp_plan_for  # noqa: E402
from jaxdist.pipeline.run import Pipelined  # noqa: E402
from jaxdist.train.trainer import flops_per_token  # noqa: E402

DATASHEET_BF16_PEAK = {"H100": 989e12, "H200": 989e12}  # dense, per GPU, by a substring of device_kind
RESULT = "STRATEGIES_RESULT "  # how a child's JSON line starts


def optimizer() -> optax.GradientTransformation:
    return optax.adamw(3e-4)


def mesh_for(devices, shape: tuple, names: tuple, backend: str | None) -> Mesh:
    """A mesh over `devices`; with the nccl backend, also jaxdist's communicators for it."""
    mesh = Mesh(np.asarray(devices).reshape(shape), names, axis_types=(AxisType.Explicit,) * len(names))
    if backend == "nccl":
        nccl.init(mesh, blocking=os.environ.get("JAXDIST_BENCH_NCCL_BLOCKING", "1") != "0")
    return mesh


# One builder per kind of configuration: (model, devices, batch_for, backend) -> (run, batch), where
# `batch_for(mesh)` is the global batch for that mesh's GPU count, split over its data axes.


def plain_jit(model, devices, batch_for, backend):
    # XLA's run on one device is exactly the plain loop: jit(value_and_grad + optax), state donated
    mesh = mesh_for(devices[:1], (1,), ("dp",), None)
    batch = batch_for(mesh)
    return AutoShardedRun(mesh, model, optimizer(), next_token_loss, batch_axes=("dp",), shard_axis=None), batch


def xla_auto(axis: str, shard_axis: str | None):
    def build(model, devices, batch_for, backend):
        mesh = mesh_for(devices, (len(devices),), (axis,), None)
        batch = batch_for(mesh)
        run = AutoShardedRun(mesh, model, optimizer(), next_token_loss, batch_axes=(axis,), shard_axis=shard_axis)
        return run, batch

    return build


def ddp(zero1: bool, reduce_dtype=None, pack_buckets: bool = True):
    """reduce_dtype=bfloat16 reduces the gradients in bfloat16, as XLA's automatic DP does;
    pack_buckets=False runs each bucket as one grouped collective over its parameters (no bucket buffers)."""

    def build(model, devices, batch_for, backend):
        mesh = mesh_for(devices, (len(devices),), ("dp",), backend)
        batch = batch_for(mesh)
        size = int(os.environ.get("JAXDIST_BENCH_BUCKET_SIZE", 0)) or DEFAULT_BUCKET_SIZE
        run = DDP(
            mesh, zero1=zero1, bucket_size=size, reduce_dtype=reduce_dtype, pack_buckets=pack_buckets, backend=backend
        )
        return run.prepare(model, optimizer(), next_token_loss, batch), batch

    return build


def fsdp(model, devices, batch_for, backend):
    mesh = mesh_for(devices, (len(devices),), ("fsdp",), backend)
    batch = batch_for(mesh)
    return FSDP(mesh, backend=backend).prepare(model, optimizer(), Units(embed_inputs, head_loss), batch), batch


def engine_zero3(remat: bool | None = None, compute_dtype=None, pack_units: bool = True):
    """The engine's ZeRO-3 over fsdp; remat=False keeps activations (rebuilds only the weights' residuals);
    compute_dtype=bfloat16 gathers the weights in bfloat16 (each shard cast before its gather, the cast
    the model makes anyway) and reduces their gradients in bfloat16; pack_units=False gathers and reduces
    each unit as one grouped collective over its pieces (no packing copies)."""

    def build(model, devices, batch_for, backend):
        mesh = mesh_for(devices, (len(devices),), ("fsdp",), backend)
        batch = batch_for(mesh)
        run = Parallel(mesh, remat=remat, compute_dtype=compute_dtype, pack_units=pack_units, backend=backend)
        return run.prepare(model, optimizer(), UNITS, batch), batch

    return build


def engine_tp(data_axis: str, sequence_parallel: bool = False):
    def build(model, devices, batch_for, backend):
        if len(devices) % 2:
            raise ValueError(f"{data_axis} x tp needs an even number of GPUs, not {len(devices)}")
        mesh = mesh_for(devices, (len(devices) // 2, 2), (data_axis, "tp"), backend)
        batch = batch_for(mesh)
        parallel = Parallel(mesh, plan=tp_plan_for(model.cfg), sequence_parallel=sequence_parallel, backend=backend)
        return parallel.prepare(model, optimizer(), UNITS, batch), batch

    return build


def pipeline(schedule: str, virtual: int = 1):
    def build(model, devices, batch_for, backend):
        pp = len(devices)
        if pp < 2:
            raise ValueError("the pipeline needs 2+ GPUs")
        mesh = mesh_for(devices, (pp,), ("pp",), backend)
        batch = batch_for(mesh)
        rows = batch["tokens"].shape[0]
        m = int(os.environ.get("JAXDIST_BENCH_MICROBATCHES", 0)) or (4 * pp if rows % (4 * pp) == 0 else pp)
        strategy = Pipelined(mesh, microbatches=m, schedule=schedule, virtual=virtual, backend=backend)
        return strategy.prepare(model, optimizer(), UNITS, batch), batch

    return build


CONFIGS = {  # name: (builder, comm backend)
    "1gpu": (plain_jit, None),
    "xla-dp": (xla_auto("dp", None), None),
    "xla-fsdp": (xla_auto("fsdp", "fsdp"), None),
    **{
        f"{name}-{backend}": (builder, backend)
        for name, builder in (
            ("ddp", ddp(zero1=False)),
            ("zero1", ddp(zero1=True)),
            ("fsdp", fsdp),
            ("zero3", engine_zero3()),
            ("zero3keep", engine_zero3(remat=False)),
            ("zero3keepunpacked", engine_zero3(remat=False, pack_units=False)),
            ("zero1bf16", ddp(zero1=True, reduce_dtype=jnp.bfloat16)),
            ("zero1unpacked", ddp(zero1=True, pack_buckets=False)),
            ("zero1bf16unpacked", ddp(zero1=True, reduce_dtype=jnp.bfloat16, pack_buckets=False)),
            ("zero3bf16", engine_zero3(compute_dtype=jnp.bfloat16)),
            ("zero3keepbf16", engine_zero3(remat=False, compute_dtype=jnp.bfloat16)),
            ("zero3keepbf16unpacked", engine_zero3(remat=False, compute_dtype=jnp.bfloat16, pack_units=False)),
            ("dptp", engine_tp("dp")),
            ("dptpsp", engine_tp("dp", sequence_parallel=True)),
            ("fsdptp", engine_tp("fsdp")),
            ("ppgpipe", pipeline("gpipe")),
            ("pp1f1b", pipeline("1f1b")),
            ("ppinterleaved", pipeline("interleaved", virtual=2)),
        )
        for backend in ("xla", "nccl")
    },
}


def host_device() -> jax.Device:
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS without cpu: build on the first GPU instead
        return jax.devices()[0]


def measure(flavor: str, config: str, per_gpu_batch: int, steps: int, profile: str | None = None) -> dict:
    """Build one configuration in this process, time its steps and read its peak memory.

    With `profile` (a folder), also trace 3 more steps there, write the compiled program's HLO
    beside it and print a per-op summary (bench/op_profile.py)."""
    builder, backend = CONFIGS[config]
    devices = jax.devices()
    on_gpu = devices[0].platform == "gpu"
    cfg = dataclasses.replace(FLAVORS[flavor], dtype=jnp.bfloat16, attention="cudnn" if on_gpu else None)
    rng = np.random.default_rng(0)

    def batch_for(mesh):
        data_axes = tuple(a for a in mesh.axis_names if a not in ("tp", "pp"))
        tokens = rng.integers(0, cfg.vocab_size, (per_gpu_batch * mesh.size, cfg.seq_len + 1), dtype=np.int32)
        return {"tokens": jax.device_put(tokens, NamedSharding(mesh, P(data_axes)))}

    t0 = time.perf_counter()
    # built on the host, so the GPUs hold only what the strategy puts there (its peak memory is its own)
    with jax.default_device(host_device()):
        model = GPT(cfg, nnx.Rngs(0))
        nnx.update(model, jax.tree.map(np.asarray, nnx.state(model)))  # host arrays, committed to no device
    run, batch = builder(model, devices, batch_for, backend)
    setup = time.perf_counter() - t0
    state, metrics = run.step(run.state, batch)  # compiles
    jax.block_until_ready(state)
    first = time.perf_counter() - t0 - setup
    state, metrics = run.step(state, batch)
    # as the trainer runs: steps dispatched back to back (the host's dispatch of step i+1 overlaps
    # the devices' step i), one wait at the end; the throughput figure
    # three windows, the median one: a single window's mean takes any one-off stall of the host whole
    windows = []
    for _ in range(3):
        jax.block_until_ready(state)
        t = time.perf_counter()
        for _ in range(steps):
            state, metrics = run.step(state, batch)
        jax.block_until_ready(state)
        windows.append((time.perf_counter() - t) / steps)
    pipelined = float(np.median(windows))
    # one step at a time, waited each time: the step's latency including the host's dispatch, and
    # the dispatch alone (the call's return, on idle devices)
    times, dispatch = [], []
    for _ in range(steps):
        jax.block_until_ready(state)
        t = time.perf_counter()
        state, metrics = run.step(state, batch)
        dispatch.append(time.perf_counter() - t)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t)
    used = list(batch["tokens"].sharding.device_set)
    stats = [d.memory_stats() for d in used]
    if profile:
        _profile(run, state, batch, profile, f"{flavor}-{config}")
    seconds = pipelined
    return {
        "device": devices[0].device_kind,
        "gpus": len(used),
        "params": cfg.num_params(),
        "flops_per_token": flops_per_token(cfg),
        "ms": 1e3 * seconds,
        "sync_ms": 1e3 * float(np.median(times)),
        "dispatch_ms": 1e3 * float(np.median(dispatch)),
        "tokens_per_gpu": per_gpu_batch * cfg.seq_len / seconds,
        "peak_gib": max(s["peak_bytes_in_use"] for s in stats) / 2**30 if all(stats) else None,
        "loss": float(metrics["loss"]),
        "setup_s": setup,
        "first_step_s": first,
    }


def _profile(run, state, batch, folder: str, name: str) -> None:
    from op_profile import summarize

    os.makedirs(folder, exist_ok=True)
    try:
        hlo = run.step.lower(state, batch).compile().as_text()
    except Exception as e:  # noqa: BLE001 (the trace is still worth having)
        hlo = f"could not lower: {e}"
    with open(os.path.join(folder, f"{name}.hlo.txt"), "w") as f:
        f.write(hlo)
    trace = os.path.join(folder, name)
    with jax.profiler.trace(trace):
        for _ in range(3):
            state, _ = run.step(state, batch)
        jax.block_until_ready(state)
    summary = summarize(trace, steps=3)
    with open(os.path.join(folder, f"{name}.summary.txt"), "w") as f:
        f.write(summary)
    print(f"== {name}\n{summary}", file=sys.stderr, flush=True)


def one(args) -> None:
    """The child: print one JSON line, the measurement or the error's first line."""
    try:
        out = measure(args.models, args.one, args.per_gpu_batch, args.steps, args.profile)
    except Exception as e:  # noqa: BLE001 (any failure is a row of the table)
        lines = [line for line in str(e).splitlines() if line.strip()] or [""]
        out = {"error": f"{type(e).__name__}: {lines[0]}"[:200]}
    print(RESULT + json.dumps(out), flush=True)


def spawn(flavor: str, config: str, args) -> dict:
    """Run one configuration in its own process; a timeout or a crash becomes an error."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one", config, "--models", flavor]
    cmd += ["--steps", str(args.steps), "--per-gpu-batch", str(args.per_gpu_batch)] + (["--cpu"] if args.cpu else [])
    cmd += ["--profile", args.profile] if args.profile else []
    return run_child(cmd, args.timeout, RESULT)


def table(rows: list[tuple[str, str, dict]], baseline: str) -> str:
    """The results as a Markdown table (a failed configuration shows its error)."""
    head = ["model", "config", "GPUs", "ms/step", "sync ms", "dispatch ms", "tokens/s/GPU", "MFU", "peak GiB/GPU"]
    head += ["weak scaling", f"vs {baseline}", "loss", "startup s", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    tps = {(f, c): r["tokens_per_gpu"] for f, c, r in rows if "error" not in r}
    for flavor, config, r in rows:
        if "error" in r:
            lines.append(f"| {flavor} | {config} |" + " - |" * (len(head) - 3) + f" {r['error']} |")
            continue
        peak = next((v for k, v in DATASHEET_BF16_PEAK.items() if k in r["device"]), None)
        cells = [
            flavor,
            config,
            r["gpus"],
            f"{r['ms']:.1f}",
            f"{r['sync_ms']:.1f}" if "sync_ms" in r else "-",
            f"{r['dispatch_ms']:.1f}" if "dispatch_ms" in r else "-",
            f"{r['tokens_per_gpu']:,.0f}",
            f"{100 * r['tokens_per_gpu'] * r['flops_per_token'] / peak:.1f}%" if peak else "-",
            f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-",
            _ratio(r["tokens_per_gpu"], tps.get((flavor, "1gpu"))),
            _ratio(r["tokens_per_gpu"], tps.get((flavor, baseline))),
            f"{r['loss']:.4f}",
            f"{r['setup_s'] + r['first_step_s']:.0f}",
            "",
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def _ratio(value: float, reference: float | None) -> str:
    return f"{value / reference:.2f}" if reference else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="350m,1.3b", help="flavors of jaxdist.models.gpt.FLAVORS, comma-separated")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"a subset of {','.join(CONFIGS)}")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (median) after 2 warm-up steps")
    ap.add_argument("--per-gpu-batch", type=int, default=8, help="sequences per GPU")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per configuration")
    ap.add_argument("--baseline", default="xla-fsdp", help="the configuration of the ratio column")
    ap.add_argument("--cpu", action="store_true", help="dry run on 8 simulated CPU devices (not recorded)")
    ap.add_argument("--profile", help="a folder: trace 3 steps of each configuration there, with its HLO")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure this configuration, print JSON
    args = ap.parse_args()
    if args.one:
        return one(args)
    models, configs = args.models.split(","), args.configs.split(",")
    unknown = [m for m in models if m not in FLAVORS] + [c for c in configs if c not in CONFIGS]
    if unknown:
        sys.exit(f"unknown models/configs {unknown}; models are {list(FLAVORS)}, configs {list(CONFIGS)}")
    rows = []
    for flavor in models:
        for config in configs:
            t0 = time.perf_counter()
            rows.append((flavor, config, spawn(flavor, config, args)))
            print(f"{flavor} {config} ({time.perf_counter() - t0:.0f} s): {rows[-1][2]}", flush=True)
    done = [r for _, _, r in rows if "error" not in r]
    n = max((r["gpus"] for r in done), default=0)
    device = f"{n} x {done[0]['device']}" if done else "unknown device"
    header = (
        f"{device}, jax {jax.__version__}, {args.per_gpu_batch} sequences per GPU, bf16 compute, float32 "
        f"parameters, AdamW, median of 3 windows of {args.steps} steps back to back (sync ms: median of "
        f"{args.steps} waited steps); "
        "MFU on the datasheet dense bf16 peak"
    )
    out = header + "\n\n" + table(rows, args.baseline)
    print("\n" + out)
    if not args.cpu:
        nonblocking = "JAXDIST_BENCH_NCCL_BLOCKING=0 " if os.environ.get("JAXDIST_BENCH_NCCL_BLOCKING") == "0" else ""
        command = nonblocking + "python bench/strategies.py " + " ".join(sys.argv[1:])
        append_result("Strategies on all GPUs: speed, MFU, memory", command, device, out)


if __name__ == "__main__":
    main()
