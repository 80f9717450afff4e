"""Pipeline speed against its schedule and against ZeRO-1 on the same devices, in one command.

    python bench/pipeline_speed.py          # on 2 GPUs (H200): GPT-350M and 1.3B, pp=2
    python bench/pipeline_speed.py --cpu    # a small model on 2 CPU devices: checks the script, not recorded

Every configuration runs in its own subprocess (its peak memory is its own; a crash or OOM costs only
its row). Per model and micro-batch count m (4, 8): `Pipelined` pp=2 with 1F1B, interleaved (v=2) and
ZB-H1, activations kept (the default); ZeRO-1 (DDP, dp=2) on the same two devices and global batch;
and one stage alone on one device (a GPT of n_layers / pp blocks with the embedding and head, a
micro-batch's rows, jit(value_and_grad), the AdamW update left out): its forward + backward time t.

`--per-rank` adds the same schedules as per-rank programs (`Pipelined(per_rank_programs=True)`): two
processes, one GPU each (with `--cpu`: one CPU device each, gloo), each tracing its own pp rank's
ticks; the row is process 0's measurement.

Columns: ms/step (median of three windows of `--steps` steps, after two warm-up steps); MFU =
tokens/s x FLOPs per token (`jaxdist.train.trainer.flops_per_token`) / (989 TFLOP/s x devices);
peak GiB (the devices' largest `peak_bytes_in_use`); host ms, the time until the step call returns
(the host's dispatch, which equals the step time where the host runs each tick), beside the step's
time until `block_until_ready`; ideal = t / v x the table's timed span / 3 (the table's ticks, each as
long as its longest op, at F : B : W = 1 : 2 (unsplit) or 1 : 1 : 1 of a stage's forward + backward
`schedule.Schedule.span`); step / ideal.
"""

import os
import sys

if "--cpu" in sys.argv:  # before JAX starts: two CPU devices (one in each process of a per-rank kind)
    os.environ["JAX_PLATFORMS"] = "cpu"
    count = 1 if "--process" in sys.argv else 2
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from results import append_result, run_child  # noqa: E402

from jaxdist.ddp.run import DDP  # noqa: E402
from jaxdist.models.gpt import FLAVORS, GPT, UNITS, next_token_loss  # noqa: E402
from jaxdist.pipeline import schedule as ps  # noqa: E402
from jaxdist.pipeline.run import Pipelined  # noqa: E402
from jaxdist.train.trainer import flops_per_token  # noqa: E402

PEAK = 989e12  # H100 / H200 datasheet dense bf16, FLOP/s
PP = 2
RESULT = "PIPELINE_SPEED_RESULT "
KINDS = {"1f1b": ("1f1b", 1), "interleaved": ("interleaved", 2), "zb-h1": ("zb-h1", 1)}


def model_config(flavor: str, cpu: bool, layers: int | None = None):
    cfg = dataclasses.replace(FLAVORS[flavor], dtype=jnp.bfloat16, attention=None if cpu else "cudnn")
    return dataclasses.replace(cfg, n_layers=layers) if layers else cfg


def tokens(cfg, rows: int):
    data = np.random.default_rng(0).integers(0, cfg.vocab_size, (rows, cfg.seq_len + 1), dtype=np.int32)
    return {"tokens": jnp.asarray(data)}


def timed(step, state, batch, steps: int) -> tuple[float, float, object]:
    """(median seconds a step, median seconds until the step call returned, state) over three windows."""
    state, metrics = step(state, batch)  # compiles
    state, metrics = step(state, batch)
    windows, hosts = [], []
    for _ in range(3):
        jax.block_until_ready((state, metrics))
        start, host = time.perf_counter(), 0.0
        for _ in range(steps):
            called = time.perf_counter()
            state, metrics = step(state, batch)
            host += time.perf_counter() - called
            jax.block_until_ready((state, metrics))  # each step's own dispatch and run, not overlapped
        windows.append((time.perf_counter() - start) / steps)
        hosts.append(host / steps)
    return statistics.median(windows), statistics.median(hosts), metrics


def peak_gib() -> float | None:
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()[:PP]]
    return max(peaks) / 2**30 if all(peaks) else None


PER_RANK = "-per-rank"  # a kind's suffix: the schedule as per-rank programs, one process per pp rank


def measure(kind: str, flavor: str, m: int, batch_size: int, steps: int, cpu: bool) -> dict:
    cfg = model_config(flavor, cpu)
    batch = tokens(cfg, batch_size)
    if kind.endswith(PER_RANK):
        return measure_per_rank(kind.removesuffix(PER_RANK), cfg, m, batch, steps)
    with jax.default_device(jax.devices("cpu")[0]):  # built on the host: the devices hold only what the run puts there
        model = GPT(cfg, nnx.Rngs(0))
    mesh_devices = np.asarray(jax.devices()[:PP])
    out = {"flops_per_token": flops_per_token(cfg), "tokens": batch_size * cfg.seq_len}
    if kind == "stage":  # one stage on one device: a micro-batch through n_layers / pp blocks, embed and head
        stage_cfg = model_config(flavor, cpu, layers=cfg.n_layers // PP)
        stage = GPT(stage_cfg, nnx.Rngs(0))
        graphdef, params = nnx.split(stage)
        micro = tokens(stage_cfg, batch_size // m)

        @jax.jit
        def grads(params, batch):
            return jax.value_and_grad(lambda p: next_token_loss(nnx.merge(graphdef, p), batch))(params)

        def step(params, batch):
            return params, grads(params, batch)  # the gradients are the output: waited for

        seconds, host, _ = timed(step, params, micro, steps)
        return {**out, "ms": 1e3 * seconds, "host_ms": 1e3 * host}
    if kind == "zero1":
        mesh = jax.sharding.Mesh(mesh_devices, ("dp",))
        run = DDP(mesh, zero1=True).prepare(model, optax.adamw(3e-4), next_token_loss, batch)
    else:
        schedule, v = KINDS[kind]
        mesh = jax.sharding.Mesh(mesh_devices, ("pp",))
        strategy = Pipelined(mesh, microbatches=m, schedule=schedule, virtual=v)
        run = strategy.prepare(model, optax.adamw(3e-4), UNITS, batch)
        out["span"], out["v"] = run.table.span, v
    seconds, host, metrics = timed(run.step, run.state, batch, steps)
    return {**out, "ms": 1e3 * seconds, "host_ms": 1e3 * host, "peak_gib": peak_gib(), "loss": float(metrics["loss"])}


def measure_per_rank(kind: str, cfg, m: int, batch, steps: int) -> dict:
    """`kind`'s schedule as per-rank programs in this process of two (jax.distributed already joined)."""
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        model = GPT(cfg, nnx.Rngs(0))
    schedule, v = KINDS[kind]
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:PP]), ("pp",))
    strategy = Pipelined(mesh, microbatches=m, schedule=schedule, virtual=v, per_rank_programs=True)
    run = strategy.prepare(model, optax.adamw(3e-4), UNITS, batch)
    host = {k: np.asarray(x) for k, x in batch.items()}
    placed = {
        k: jax.make_array_from_callback(x.shape, run.step.batch_sharding, lambda i, x=x: x[i]) for k, x in host.items()
    }
    seconds, host_s, metrics = timed(run.step, run.state, placed, steps)
    out = {"flops_per_token": flops_per_token(cfg), "tokens": batch["tokens"].shape[0] * cfg.seq_len}
    loss = float(np.asarray(metrics["loss"].addressable_data(0)))
    return {
        **out,
        "span": run.table.span,
        "v": v,
        "ms": 1e3 * seconds,
        "host_ms": 1e3 * host_s,
        "peak_gib": peak_gib(),
        "loss": loss,
    }


def child(args) -> None:
    if args.process is not None:  # one of two processes of a per-rank kind
        if args.cpu:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, PP, args.process)
    try:
        out = measure(args.one, args.flavor, args.m, args.batch, args.steps, args.cpu)
    except Exception as e:  # noqa: BLE001 (any failure is a row of the table)
        lines = [line for line in str(e).splitlines() if line.strip()] or [""]
        out = {"error": f"{type(e).__name__}: {lines[0]}"[:200]}
    print(RESULT + json.dumps(out), flush=True)


def spawn(args, kind: str, flavor: str, m: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", kind, "--flavor", flavor, "--m", str(m)]
    cmd += ["--steps", str(args.steps), "--batch", str(args.batch)] + (["--cpu"] if args.cpu else [])
    if not kind.endswith(PER_RANK):
        return run_child(cmd, args.timeout, RESULT)
    with socket.socket() as s:  # a free port for the two processes' coordinator
        s.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    procs = []
    for process in range(PP):
        env = dict(os.environ)
        if not args.cpu:
            env["CUDA_VISIBLE_DEVICES"] = str(process)
        one = [*cmd, "--process", str(process), "--coordinator", coordinator]
        procs.append(subprocess.Popen(one, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            return {"error": f"timeout after {args.timeout} s"}
        found = [line for line in stdout.splitlines() if line.startswith(RESULT)]
        tail = [line for line in stderr.splitlines() if line.strip()] or [""]
        results.append(json.loads(found[-1][len(RESULT) :]) if found else {"error": tail[-1][:200]})
    return results[0]


def row(flavor: str, m: int, name: str, r: dict, stage: dict) -> str:
    if "error" in r:
        return f"| {flavor} | {m} | {name} | {r['error']} | | | | | | |"
    mfu = r["tokens"] / (r["ms"] / 1e3) * r["flops_per_token"] / (PEAK * PP)
    peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "-"
    ideal = ratio = "-"
    if "span" in r and "ms" in stage:
        ideal_ms = stage["ms"] / r["v"] * r["span"] / 3
        ideal, ratio = f"{ideal_ms:.1f}", f"{r['ms'] / ideal_ms:.2f}"
    cells = [flavor, m, name, f"{r['ms']:.1f}", f"{100 * mfu:.1f}%", peak, f"{r['host_ms']:.1f}", ideal, ratio]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="tiny models on 2 CPU devices (checks the script; not recorded)")
    p.add_argument("--flavors", default=None, help="comma-separated (default 350m,1.3b; with --cpu small-cpu)")
    p.add_argument("--microbatches", default="4,8", help="comma-separated micro-batch counts")
    p.add_argument("--steps", type=int, default=None, help="steps per timed window (default 10; with --cpu 2)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (the global batch)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per configuration")
    p.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--flavor", help=argparse.SUPPRESS)
    p.add_argument("--m", type=int, help=argparse.SUPPRESS)
    p.add_argument("--per-rank", action="store_true", help="also each schedule as per-rank programs (2 processes)")
    p.add_argument("--process", type=int, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.steps = args.steps or (2 if args.cpu else 10)
    if args.one:
        return child(args)
    if len(jax.devices()) < PP:
        raise SystemExit(f"pipeline_speed needs {PP} devices, found {len(jax.devices())}; on a CPU pass --cpu")
    flavors = (args.flavors or ("small-cpu" if args.cpu else "350m,1.3b")).split(",")
    lines = [
        "| model | m | strategy | ms/step | MFU | peak GiB | host ms/step | ideal ms | step / ideal |",
        "|" + " --- |" * 9,
    ]
    for flavor in flavors:
        for m in (int(x) for x in args.microbatches.split(",")):
            stage = spawn(args, "stage", flavor, m)
            print(f"{flavor} m={m} one stage: {stage}", flush=True)
            stage_ms = f"{stage['ms']:.2f}" if "ms" in stage else stage.get("error", "-")
            lines.append(f"| {flavor} | {m} | one stage, one micro-batch | {stage_ms} | | | | | |")
            per_rank = [k + PER_RANK for k in KINDS] if args.per_rank else []
            for kind in (*KINDS, *per_rank, "zero1"):
                r = spawn(args, kind, flavor, m)
                print(f"{flavor} m={m} {kind}: {r}", flush=True)
                lines.append(row(flavor, m, "ZeRO-1 dp=2" if kind == "zero1" else f"pp=2 {kind}", r, stage))
    tables = "\n".join(lines)
    print(tables)
    for flavor in flavors:
        for m in (int(x) for x in args.microbatches.split(",")):
            for name, (schedule, v) in KINDS.items():
                print(f"{flavor} m={m} {name}: " + str(ps.make(schedule, PP, m, v)).splitlines()[-1])
    if not args.cpu and not args.no_record:
        device = f"{PP} x {jax.devices()[0].device_kind}, jax {jax.__version__}"
        command = "python bench/pipeline_speed.py " + " ".join(sys.argv[1:])
        append_result("Pipeline speed against its schedule and ZeRO-1", command.strip(), device, tables)


if __name__ == "__main__":
    main()
