"""Speed on one GPU, in one command: what each strategy costs where nothing moves, MFU by model size,
and what checkpoints cost the training loop against the disk's own write bandwidth.

    python bench/one_gpu.py                      # on a GPU (an H200): the figures of docs/benchmarks.md
    python bench/one_gpu.py --cpu                # tiny models on the CPU: checks the script, not recorded

Every configuration runs in its own subprocess (its peak memory is its own; a crash or OOM costs only
its row). Three tables:

(a) Strategy overhead on one device: a plain `jit` of value_and_grad + optax AdamW (state donated)
    against DDP, ZeRO-1 and the unit engine (`Parallel`) on a one-device mesh, and what
    `jaxdist train` builds there by default (`jaxdist.train.trainer.parallelize`); GPT 350M and 1.3B,
    batch 8 x 1024, bf16 compute with float32 parameters, cuDNN flash attention on GPU. After two
    warm-up steps, ms/step is the median of three windows of `--steps` steps dispatched back to back;
    peak GiB is the device's `peak_bytes_in_use`; the ratio is against the plain jit.
(b) MFU by model size: tokens/s x FLOPs per token / 989 TFLOP/s (the H100/H200 datasheet dense bf16
    peak), FLOPs per token = 6 N (the matmuls, forward and backward) + 12 L d T (attention's scores
    and values), as `jaxdist.train.trainer.flops_per_token` counts them.
(c) Checkpoint cost: `jaxdist train` on GPT-124M, 16 x 1024, synthetic data, with no checkpoints and
    one every 50 and every 10 steps (tokens/s ratios to none); one save of the same train state through
    `jaxdist.train.checkpoint.Checkpoints` timed by phase (`save()`: the loop's wait, enqueuing the
    device-to-host copies; then in the background the copies, the writes and the checksums); and
    the raw write bandwidth of the same
    directory measured in the same run (the same bytes, fsync'd, from 1 and from 8 threads).
"""

import os
import sys

# before JAX starts, inherited by every configuration's process: one device (the trainer's command line
# would otherwise make 8 CPU devices, and use every GPU of a larger host)
if "--cpu" in sys.argv:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"
else:
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import checkpoint_overhead  # noqa: E402
from checkpoint_write import raw_write  # noqa: E402
from results import append_result, run_child  # noqa: E402
from xla_auto import AutoShardedRun  # noqa: E402

from jaxdist.ddp.run import DDP  # noqa: E402
from jaxdist.engine.run import Parallel  # noqa: E402
from jaxdist.models.gpt import FLAVORS, GPT, UNITS, next_token_loss  # noqa: E402
from jaxdist.train.trainer import flops_per_token  # noqa: E402

PEAK = 989e12  # H100 / H200 datasheet dense bf16, FLOP/s
RESULT = "ONE_GPU_RESULT "  # how a child's JSON line starts
STRATEGIES = ("plain jit", "DDP", "ZeRO-1", "engine Parallel", "trainer default")


def one_device_mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((1,), ("dp",), devices=jax.devices()[:1])


def adamw() -> optax.GradientTransformation:
    return optax.adamw(3e-4)


def trainer_default(model, batch, flavor: str, cpu: bool):
    """What `jaxdist train` builds on one device with the default `parallel` section."""
    from jaxdist.train import config as config_lib
    from jaxdist.train import trainer

    c = config_lib.load(None, [f"model.flavor={flavor}", "model.dtype=bfloat16"])
    config_lib.validate(c)
    return trainer.parallelize(c, one_device_mesh(), model, adamw(), batch)


def build(strategy: str, model, batch, flavor: str, cpu: bool):
    if strategy == "plain jit":  # bench/strategies.py's 1-GPU baseline: jit(value_and_grad + optax), donated
        return AutoShardedRun(one_device_mesh(), model, adamw(), next_token_loss, batch_axes=("dp",), shard_axis=None)
    if strategy in ("DDP", "ZeRO-1"):
        return DDP(one_device_mesh(), zero1=strategy == "ZeRO-1").prepare(model, adamw(), next_token_loss, batch)
    if strategy == "engine Parallel":
        return Parallel(one_device_mesh()).prepare(model, adamw(), UNITS, batch)
    if strategy == "trainer default":
        return trainer_default(model, batch, flavor, cpu)
    raise SystemExit(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")


def warmed_gpt_step(flavor: str, batch_size: int, strategy: str, warmup: int = 3):
    """A GPT flavor's step under `strategy` on one device (bf16 compute; cuDNN attention on a GPU),
    compiled and run `warmup` times on one random batch: (run, state, batch, config), for the scripts
    that profile it."""
    cfg = dataclasses.replace(
        FLAVORS[flavor], dtype=jnp.bfloat16, attention="cudnn" if jax.default_backend() == "gpu" else None
    )
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), dtype=np.int32)
    batch = {"tokens": jnp.asarray(tokens)}
    with jax.default_device(jax.devices("cpu")[0]):
        model = GPT(cfg, nnx.Rngs(0))
    run = build(strategy, model, batch, flavor, jax.default_backend() != "gpu")
    state = run.state
    for _ in range(warmup):
        state, _ = run.step(state, batch)
    jax.block_until_ready(state)
    return run, state, batch, cfg


def measure_strategy(strategy: str, flavor: str, batch_size: int, steps: int, cpu: bool) -> dict:
    """Build one configuration in this process, time its steps and read its peak memory."""
    cfg = dataclasses.replace(FLAVORS[flavor], dtype=jnp.bfloat16, attention=None if cpu else "cudnn")
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), dtype=np.int32)
    batch = {"tokens": jnp.asarray(tokens)}
    with jax.default_device(jax.devices("cpu")[0]):  # built on the host: the GPU holds only what the run puts there
        model = GPT(cfg, nnx.Rngs(0))
    run = build(strategy, model, batch, flavor, cpu)
    state, metrics = run.step(run.state, batch)  # compiles
    state, metrics = run.step(state, batch)
    windows = []
    for _ in range(3):  # the median window: one window's mean would take a one-off host stall whole
        jax.block_until_ready(state)
        start = time.perf_counter()
        for _ in range(steps):
            state, metrics = run.step(state, batch)
        jax.block_until_ready(state)
        windows.append((time.perf_counter() - start) / steps)
    seconds = statistics.median(windows)
    stats = jax.devices()[0].memory_stats()
    return {
        "ms": 1e3 * seconds,
        "peak_gib": stats["peak_bytes_in_use"] / 2**30 if stats and "peak_bytes_in_use" in stats else None,
        "tokens_per_s": batch_size * cfg.seq_len / seconds,
        "flops_per_token": flops_per_token(cfg),
        "params": cfg.num_params(),
        "loss": float(metrics["loss"]),
        "device": jax.devices()[0].device_kind,
    }


def measure_save(flavor: str, directory: Path, saves: int) -> dict:
    """Save a GPT train state (parameters and two AdamW moments, float32, on the device) through
    `Checkpoints` `saves` times after a warm-up save; the median of each phase. Twice: saves apart (every
    checkpoint kept, so no deletion runs beside a timed save, as in training, where saves are steps apart
    and an older checkpoint's deletion has long finished) and back to back with two kept (the oldest
    checkpoint's deletion on orbax's thread runs beside the next save's writes)."""
    cfg = FLAVORS[flavor]
    params = nnx.to_pure_dict(nnx.state(GPT(cfg, nnx.Rngs(0)), nnx.Param))
    state = jax.device_put({"params": params, "mu": params, "nu": params}, jax.devices()[0])
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    apart = _timed_saves(state, directory, saves, keep=saves + 1)
    back_to_back = _timed_saves(state, directory, saves, keep=2)
    host = [np.asarray(x) for x in jax.tree.leaves(state)]
    raw = {
        threads: statistics.median(raw_write(directory / "raw", host, threads) for _ in range(3)) for threads in (1, 8)
    }
    out = {**apart, "back to back": back_to_back["written and summed"]}
    return {**out, "bytes": nbytes, "raw_1": raw[1], "raw_8": raw[8]}


def _timed_saves(state, directory: Path, saves: int, keep: int) -> dict:
    from jaxdist.train.checkpoint import Checkpoints

    ckpt = Checkpoints(directory, keep=keep)
    phases = {"save()": [], "written and summed": [], "copy_s": [], "write_s": [], "checksum_s": []}
    try:
        for step in range(saves + 1):
            start = time.perf_counter()
            ckpt.save(step, state, {"step": step})
            returned = time.perf_counter()
            ckpt.wait()
            if step:  # the first save warms up
                phases["save()"].append(returned - start)
                phases["written and summed"].append(time.perf_counter() - returned)
                for part, seconds in ckpt.timings.items():  # the background's parts
                    phases[part].append(seconds)
    finally:
        ckpt.close()
        shutil.rmtree(directory, ignore_errors=True)
    return {name: statistics.median(values) for name, values in phases.items()}


def child(args) -> None:
    """Print one JSON line: the measurement, or the error's first line."""
    try:
        if args.one == "save":
            out = measure_save(args.flavor, Path(args.dir), args.saves)
        else:
            out = measure_strategy(args.one, args.flavor, args.batch, args.steps, args.cpu)
    except Exception as e:  # noqa: BLE001 (any failure is a row of the table)
        lines = [line for line in str(e).splitlines() if line.strip()] or [""]
        out = {"error": f"{type(e).__name__}: {lines[0]}"[:200]}
    print(RESULT + json.dumps(out), flush=True)


def spawn(args, one: str, flavor: str, **extra) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", one, "--flavor", flavor]
    cmd += ["--steps", str(args.steps), "--batch", str(args.batch), "--saves", str(args.saves)]
    cmd += [f"--{k}={v}" for k, v in extra.items()] + (["--cpu"] if args.cpu else [])
    return run_child(cmd, args.timeout, RESULT)


def strategy_table(results: dict) -> str:
    lines = ["| model | strategy | ms/step | vs plain jit | peak GiB | peak vs plain jit |", "|" + " --- |" * 6]
    for flavor, rows in results.items():
        plain = rows.get("plain jit", {})
        for name, r in rows.items():
            if "error" in r:
                lines.append(f"| {flavor} | {name} | {r['error']} | | | |")
                continue
            ratio = f"{r['ms'] / plain['ms']:.3f}x" if "ms" in plain else "-"
            peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
            extra = f"{r['peak_gib'] - plain['peak_gib']:+.1f} GiB" if r["peak_gib"] and plain.get("peak_gib") else "-"
            lines.append(f"| {flavor} | {name} | {r['ms']:.1f} | {ratio} | {peak} | {extra} |")
    return "\n".join(lines)


def mfu_table(results: dict) -> str:
    lines = ["| model | params (M) | strategy | tokens/s | TFLOP/s | MFU |", "|" + " --- |" * 6]
    for flavor, rows in results.items():
        for name in ("plain jit", "trainer default"):
            r = rows.get(name, {})
            if "tokens_per_s" not in r:
                continue
            flops = r["tokens_per_s"] * r["flops_per_token"]
            row = f"| {flavor} | {r['params'] / 1e6:.1f} | {name} | {r['tokens_per_s']:,.0f} | {flops / 1e12:.1f} |"
            lines.append(f"{row} {100 * flops / PEAK:.1f}% |")
    return "\n".join(lines)


def checkpoint_tables(args, base: Path) -> str:
    flavor, batch, dtype = ("small-cpu", 4, "float32") if args.cpu else ("124m", 16, "bfloat16")
    loop = argparse.Namespace(flavor=flavor, dtype=dtype, batch=batch, steps=args.ckpt_steps, window=10, extra=[])
    runs = {}
    for every in (0, 50, 10):
        out = base / f"every{every}"
        shutil.rmtree(out, ignore_errors=True)
        try:
            runs[every] = checkpoint_overhead.run(out, loop, every if every > 0 else -1)
        except SystemExit as e:
            runs[every] = {"error": str(e).splitlines()[-1][:200]}
        shutil.rmtree(out, ignore_errors=True)
        print(f"checkpoints every {every}: {runs[every]}", flush=True)
    ref = runs[0].get("tokens_per_s")
    lines = [
        f"GPT-{flavor}, {batch} x {FLAVORS[flavor].seq_len} tokens, `jaxdist train`, {args.ckpt_steps} steps, "
        f"checkpoints into {base}",
        "",
        "| checkpoints | tokens/s | tokens/s vs none | checkpoint size | loop waits in saves (s per 10 steps) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for every, r in runs.items():
        name = checkpoint_overhead.config_name(every)
        if "error" in r:
            lines.append(f"| {name} | {r['error']} | | | |")
            continue
        size = f"{r['ckpt_bytes'] / 2**30:.2f} GiB" if r["ckpt_bytes"] else "-"
        wait = f"{r['wait_s']:.3f}" if r["ckpt_bytes"] else "-"
        ratio = f"{r['tokens_per_s'] / ref:.3f}" if ref else "-"
        lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {ratio} | {size} | {wait} |")
    save = spawn(args, "save", flavor, dir=base / "save")
    lines += ["", "| one save of the same train state | value |", "| --- | --- |"]
    if "error" in save:
        lines.append(f"| error | {save['error']} |")
    else:
        gib = save["bytes"] / 2**30
        rate = gib / save["written and summed"]
        lines += [
            f"| bytes | {gib:.2f} GiB |",
            f"| `save()` (the loop waits: the device-to-host copies enqueued) | {save['save()']:.3f} s |",
            f"| copied, written, fsync'd and checksummed (background; saves apart) | "
            f"{save['written and summed']:.3f} s, {rate:.2f} GiB/s |",
            f"| of which: waits for copies / writes, summed as written / the other files' sums | "
            f"{save['copy_s']:.3f} / {save['write_s']:.3f} / {save['checksum_s']:.3f} s |",
            f"| the same, saves back to back (the oldest checkpoint deleted beside the writes) | "
            f"{save['back to back']:.3f} s, {gib / save['back to back']:.2f} GiB/s |",
            f"| raw write of the same bytes, fsync, 1 thread | {gib / save['raw_1']:.2f} GiB/s |",
            f"| raw write of the same bytes, fsync, 8 threads | {gib / save['raw_8']:.2f} GiB/s |",
            f"| save vs raw 8 threads | {rate * save['raw_8'] / gib:.2f}x |",
            f"| save back to back vs raw 8 threads | {save['raw_8'] / save['back to back']:.2f}x |",
        ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="tiny models on the CPU (checks the script; not recorded)")
    p.add_argument("--flavors", default=None, help="comma-separated (default 350m,1.3b; with --cpu tiny,small-cpu)")
    p.add_argument("--steps", type=int, default=None, help="steps per timed window (default 10; with --cpu 2)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step in (a) and (b)")
    p.add_argument("--ckpt-steps", type=int, default=None, help="steps of each (c) run (default 110; --cpu 20)")
    p.add_argument("--saves", type=int, default=3, help="timed saves in (c)'s one-save table")
    p.add_argument("--dir", default=None, help="where (c) writes (default /dev/shm if present, else a temp dir)")
    p.add_argument("--skip", default="", help="comma-separated parts to leave out: a, c")
    p.add_argument("--timeout", type=int, default=900, help="seconds per configuration")
    p.add_argument("--no-record", action="store_true", help="do not append to bench/RESULTS.md")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--flavor", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.steps = args.steps or (2 if args.cpu else 10)
    args.ckpt_steps = args.ckpt_steps or (20 if args.cpu else 110)
    if args.one:
        return child(args)
    flavors = (args.flavors or ("tiny,small-cpu" if args.cpu else "350m,1.3b")).split(",")
    skip = set(args.skip.split(",")) - {""}
    shm = Path("/dev/shm")
    temp = Path(tempfile.mkdtemp(prefix="jaxdist-one-gpu-", dir=shm if shm.is_dir() else None))
    base = Path(args.dir) if args.dir else temp
    device = f"1 x {jax.devices()[0].device_kind}, jax {jax.__version__}"
    sections = []
    if "a" not in skip:
        results = {}
        for flavor in flavors:
            results[flavor] = {}
            for strategy in STRATEGIES:
                results[flavor][strategy] = spawn(args, strategy, flavor)
                print(flavor, strategy, results[flavor][strategy], flush=True)
        sections.append(("Strategy overhead on one device (bench/one_gpu.py)", strategy_table(results)))
        how = "FLOPs per token = 6 N + 12 L d T (matmuls forward and backward, attention scores and values)"
        sections.append((f"MFU by model size, peak {PEAK / 1e12:.0f} TFLOP/s; {how}", mfu_table(results)))
    if "c" not in skip:
        sections.append(("Checkpoint cost (bench/one_gpu.py)", checkpoint_tables(args, base)))
    header = f"{device}; batch {args.batch} x seq_len, bf16 compute, float32 parameters, AdamW"
    print("\n" + header)
    for title, text in sections:
        print(f"\n## {title}\n\n{text}")
    if not (args.cpu or args.no_record):
        for title, text in sections:
            append_result(title, "python bench/one_gpu.py " + " ".join(sys.argv[1:]), header, text)
    shutil.rmtree(temp, ignore_errors=True)


if __name__ == "__main__":
    main()
