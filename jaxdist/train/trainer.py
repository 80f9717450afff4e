"""The trainer: config -> mesh, model, optimizer, strategy, data -> a loop with metrics and checkpoints.

`parallelize` is the one place that turns the `parallel` section into a
strategy: tp > 1 gives DP x TP, fsdp > 1 FSDP (HSDP with dp > 1), otherwise
DDP (ZeRO-1 unless parallel.zero1=false).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.train import hooks
from jaxdist.train.checkpoint import Checkpoints, check_same_model
from jaxdist.train.config import ConfigError, TrainConfig
from jaxdist.train.gpt import FLAVORS, GPT, GPTConfig, embed_inputs, head_loss, next_token_loss

# bf16 dense matrix peak, FLOP/s, by device kind (H200: the rate measured on the lent machine)
PEAK_FLOPS = {"NVIDIA H200": 790e12, "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA A100-SXM4-80GB": 312e12}


def init_distributed() -> None:
    """Join a multi-process run: `jaxdist launch` sets JAXDIST_COORDINATOR and friends;
    under SLURM or Open MPI, jax.distributed's own detection is used."""
    if os.environ.get("JAXDIST_COORDINATOR"):
        if os.environ.get("JAXDIST_CPU_COLLECTIVES"):
            jax.config.update("jax_cpu_collectives_implementation", os.environ["JAXDIST_CPU_COLLECTIVES"])
        jax.distributed.initialize(
            coordinator_address=os.environ["JAXDIST_COORDINATOR"],
            num_processes=int(os.environ["JAXDIST_NUM_PROCESSES"]),
            process_id=int(os.environ["JAXDIST_PROCESS_ID"]),
        )
    elif os.environ.get("SLURM_NTASKS", "1") != "1" or os.environ.get("OMPI_COMM_WORLD_SIZE", "1") != "1":
        jax.distributed.initialize()


def model_config(cfg: TrainConfig) -> GPTConfig:
    m = cfg.model
    if m.flavor not in FLAVORS:
        raise ConfigError(f"unknown model.flavor {m.flavor!r}; choose one of {', '.join(FLAVORS)}")
    if m.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"model.dtype must be float32 or bfloat16, got {m.dtype!r}")
    over = {k: getattr(m, k) for k in ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size", "tie_embeddings")}
    out = dataclasses.replace(FLAVORS[m.flavor], **{k: v for k, v in over.items() if v is not None})
    out = dataclasses.replace(out, dtype=jnp.dtype(m.dtype))
    if m.dtype == "bfloat16" and jax.default_backend() == "gpu":
        out = dataclasses.replace(out, attention="cudnn")  # flash attention
    if out.d_model % out.n_heads:
        raise ConfigError(f"model.d_model={out.d_model} must be divisible by model.n_heads={out.n_heads}")
    return out


def make_mesh(cfg: TrainConfig, devices) -> jax.sharding.Mesh:
    p = cfg.parallel
    n = len(devices)
    for name in ("fsdp", "tp"):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(p, name)}")
    dp = p.dp if p.dp > 0 else n // (p.fsdp * p.tp)
    if dp < 1 or dp * p.fsdp * p.tp != n:
        raise ConfigError(
            f"parallel.dp x fsdp x tp = {p.dp} x {p.fsdp} x {p.tp} does not multiply to the {n} devices; "
            f"pick sizes whose product is {n} (dp=-1 fills in the rest)"
        )
    if p.fsdp > 1 and p.tp > 1:
        raise ConfigError("parallel.fsdp and parallel.tp cannot both be > 1 yet; use FSDP or DP x TP")
    if p.tp > 1:
        shape, names = (dp, p.tp), ("dp", "tp")
    elif p.fsdp > 1:
        shape, names = (dp, p.fsdp), ("dp", "fsdp")
    else:
        shape, names = (dp,), ("dp",)
    return jax.make_mesh(shape, names, devices=devices)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    o = cfg.optim
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=o.lr,
        warmup_steps=max(1, o.warmup_steps),
        decay_steps=max(cfg.run.steps, o.warmup_steps + 1),
        end_value=o.lr * o.min_lr_ratio,
    )
    # weight decay on every parameter: the strategies hand the optimizer flat shards, so no per-name mask
    return optax.adamw(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay), schedule


def parallelize(cfg: TrainConfig, mesh, model: GPT, optimizer, batch):
    """The strategy the `parallel` section asks for, prepared on `model`."""
    from jaxdist.ddp import DDP
    from jaxdist.fsdp import FSDP, Units
    from jaxdist.tensor_parallel import TensorParallel

    p, o = cfg.parallel, cfg.optim
    clip = o.max_grad_norm if o.max_grad_norm > 0 else None
    if o.accumulation_steps > 1 and (p.tp > 1 or p.fsdp > 1):
        raise ConfigError("optim.accumulation_steps > 1 works with DDP only; set it to 1 or use fsdp=tp=1")
    if p.backend not in ("xla", "nccl"):
        raise ConfigError(f"parallel.backend must be xla or nccl, got {p.backend!r}")
    if p.backend == "nccl":
        from jaxdist.comm import nccl

        nccl.init(mesh)
    if p.tp > 1:
        strategy = TensorParallel(
            mesh, sequence_parallel=p.sequence_parallel, remat=p.remat, max_grad_norm=clip, backend=p.backend
        )
        return strategy.prepare(model, optimizer, batch)
    if p.fsdp > 1:
        dp_axis = "dp" if mesh.shape["dp"] > 1 else None
        strategy = FSDP(
            mesh,
            dp_axis=dp_axis,
            buffers=p.buffers,
            prefetch=p.buffers - 1,
            update_in_backward=p.update_in_backward,
            max_grad_norm=None if p.update_in_backward else clip,
            skip_nonfinite=not p.update_in_backward,
            backend=p.backend,
        )
        return strategy.prepare(model, optimizer, Units(embed_inputs, head_loss), batch)
    strategy = DDP(
        mesh,
        zero1=p.zero1,
        bucket_bytes=int(p.bucket_mb * 2**20),
        accumulation_steps=o.accumulation_steps,
        max_grad_norm=clip,
        backend=p.backend,
    )
    return strategy.prepare(model, optimizer, next_token_loss, batch)


def layout_of(cfg: TrainConfig, mesh) -> dict:
    """What the exact train state depends on: if it matches a checkpoint's, that state restores as is."""
    p = cfg.parallel
    keys = ("fsdp", "tp", "zero1", "bucket_mb", "update_in_backward")
    return {"mesh": dict(mesh.shape), **{k: getattr(p, k) for k in keys}, "dtype": cfg.model.dtype}


def flops_per_token(m: GPTConfig) -> float:
    """6 N (matmuls, forward and backward) + 12 L d T (attention scores and values), per token."""
    return 6 * m.num_params() + 12 * m.n_layers * m.d_model * m.seq_len


def _host(x) -> np.ndarray:
    """A replicated array's value on this host (also in multi-process runs)."""
    return np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else np.asarray(x)


def _memory_gb(device) -> float | None:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return stats["bytes_in_use"] / 2**30 if stats and "bytes_in_use" in stats else None


class MetricsLog:
    """JSONL (and optionally TensorBoard) metrics, written by process 0."""

    def __init__(self, out_dir: Path, tensorboard: bool):
        self.enabled = jax.process_index() == 0
        self.file = (out_dir / "metrics.jsonl").open("a") if self.enabled else None
        self.tb = None
        if tensorboard and self.enabled:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                raise ConfigError("run.tensorboard=true needs tensorboardX: pip install tensorboardX") from None
            self.tb = SummaryWriter(str(out_dir / "tensorboard"))

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tb:
            for k, v in row.items():
                if isinstance(v, int | float) and k != "step" and v is not None:
                    self.tb.add_scalar(k, v, row["step"])

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()


def train(cfg: TrainConfig, *, stop_after: int | None = None) -> list[float]:
    """Run the configured training; returns the loss of every step run.

    `stop_after` ends the run early after that many steps (as an interruption
    would), saving a checkpoint: used to test resuming.
    """
    init_distributed()
    devices = jax.devices()
    mesh = make_mesh(cfg, devices)
    mcfg = model_config(cfg)
    out_dir = Path(cfg.run.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    source = hooks.source(cfg, "train", mcfg, out_dir)
    batch_axes = tuple(n for n in mesh.axis_names if n != "tp")
    batch_sharding = NamedSharding(mesh, P(batch_axes))
    n_batch = int(np.prod([mesh.shape[a] for a in batch_axes])) * cfg.optim.accumulation_steps
    if cfg.data.batch_size % n_batch:
        raise ConfigError(
            f"data.batch_size={cfg.data.batch_size} is not divisible by the {n_batch} data-parallel ranks"
            f"{' x accumulation steps' if cfg.optim.accumulation_steps > 1 else ''}; pick a multiple of {n_batch}"
        )

    model = GPT(mcfg, nnx.Rngs(cfg.run.seed))
    # host copies: every process passes the same values, which is what a multi-process jit needs
    nnx.update(model, jax.tree.map(np.asarray, nnx.state(model)))
    optimizer, schedule = make_optimizer(cfg)
    loader = hooks.Loader(source, cfg.data.batch_size, batch_sharding)
    example = {"tokens": np.zeros(loader.shape, np.int32)}
    evaluator = hooks.evaluator(cfg, mcfg, out_dir, batch_sharding)
    model_meta = {k: (str(v) if k == "dtype" or k == "param_dtype" else v) for k, v in dataclasses.asdict(mcfg).items()}
    layout = layout_of(cfg, mesh)
    ckpt = Checkpoints(out_dir, cfg.run.keep_checkpoints) if cfg.run.checkpoint_every >= 0 else None

    start = 0
    latest = ckpt.latest() if (ckpt and cfg.run.resume) else None
    if latest is not None:
        meta = ckpt.meta(latest)
        check_same_model(meta, model_meta, ckpt.directory)
        hooks.check_same_data(meta, source)
        if meta.get("layout") != layout:  # another mesh or strategy: carry the parameters over
            params = ckpt.restore_params(latest, nnx.state(model, nnx.Param))
            nnx.update(model, params)
            print(f"jaxdist: restored step {latest} parameters onto a new layout {layout}; the optimizer restarts")
    run = parallelize(cfg, mesh, model, optimizer, example)
    state = run.state
    if latest is not None:
        if meta.get("layout") == layout:
            state = ckpt.restore_state(latest, state)
        else:
            state = dataclasses.replace(state, step=jax.device_put(jnp.asarray(latest, jnp.int32), state.step.sharding))
        start = latest
        print(f"jaxdist: resumed from {ckpt.directory} at step {start}")
        if start >= cfg.run.steps:
            print(f"jaxdist: the run already has its {cfg.run.steps} steps; raise run.steps to train further")

    log = MetricsLog(out_dir, cfg.run.tensorboard)
    peak = PEAK_FLOPS.get(jax.local_devices()[0].device_kind) if mcfg.dtype == jnp.bfloat16 else None
    tokens_per_step = cfg.data.batch_size * mcfg.seq_len
    flops_step = flops_per_token(mcfg) * tokens_per_step
    end = cfg.run.steps if stop_after is None else min(cfg.run.steps, start + stop_after)
    bar = _progress(cfg, start, end)
    losses: list[float] = []
    pending: list = []
    meta_out = {"model": model_meta, "layout": layout, "config": cfg.to_dict(), "data": source.state()}

    def save(step: int):
        if ckpt is not None and step > 0 and step != ckpt.latest():  # a resumed, finished run has it already
            ckpt.save(step, state, run.params(state), {**meta_out, "step": step})

    step = start
    window_start, window_tokens = time.perf_counter(), 0
    batches = loader.batches(start)  # the data's whole state is the step: see jaxdist.train.shards
    try:
        for step in range(start, end):
            state, metrics = run.step(state, next(batches))
            pending.append(metrics["loss"])  # read back only when logging: no host sync per step
            window_tokens += tokens_per_step
            last = step + 1 == end
            evaluate = evaluator is not None and ((step + 1) % cfg.run.eval_every == 0 or last)
            if (step + 1) % max(1, cfg.run.log_every) == 0 or last or step == start or evaluate:
                losses.extend(float(_host(x)) for x in pending)
                pending.clear()
                loss = losses[-1]
                jax.block_until_ready(state)
                elapsed = time.perf_counter() - window_start
                tps = window_tokens / elapsed
                mfu = tps / tokens_per_step * flops_step / (peak * len(devices)) if peak else None
                mem = _memory_gb(jax.local_devices()[0])
                row = {
                    "step": step + 1,
                    "loss": loss,
                    "lr": float(schedule(step)),
                    "grad_norm": float(_host(metrics["grad_norm"])),
                    "tokens_per_s": tps,
                    "mfu": mfu,
                    "mem_gb": mem,
                    "skipped": bool(_host(metrics["skipped"])) if "skipped" in metrics else False,
                }
                if evaluate:
                    row["val_loss"] = evaluator(run.model(state))
                log.write(row)
                bar.update(step + 1, row)
                window_start, window_tokens = time.perf_counter(), 0
            if ckpt and cfg.run.checkpoint_every > 0 and (step + 1) % cfg.run.checkpoint_every == 0 and not last:
                save(step + 1)
        save(end)
        if cfg.run.sample_tokens > 0 and end > start:
            hooks.print_sample(cfg, run.model(state), source)
    except KeyboardInterrupt:
        # the state after the last finished step: a checkpoint of it, then stop
        done = start + len(losses) + len(pending)
        print(f"\njaxdist: interrupted; saving step {done}")
        save(done)
        raise
    finally:
        bar.close()
        log.close()
        if ckpt:
            ckpt.close()
    return losses


class _progress:
    """A tqdm bar on process 0 (or plain lines where there is no terminal)."""

    def __init__(self, cfg: TrainConfig, start: int, end: int):
        self.bar = None
        self.plain = not cfg.run.progress or jax.process_index() != 0
        if not self.plain:
            from tqdm import tqdm

            self.bar = tqdm(total=end, initial=start, unit="step", dynamic_ncols=True)
        self.quiet = jax.process_index() != 0

    def update(self, step: int, row: dict) -> None:
        parts = [f"loss {row['loss']:.4f}", f"{row['tokens_per_s']:,.0f} tok/s"]
        if "val_loss" in row:
            parts.insert(1, f"val {row['val_loss']:.4f}")
        if row["mfu"] is not None:
            parts.append(f"MFU {100 * row['mfu']:.1f}%")
        if row["mem_gb"] is not None:
            parts.append(f"mem {row['mem_gb']:.1f} GiB")
        text = "  ".join(parts)
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix_str(text, refresh=True)
        elif not self.quiet:
            print(f"step {step}  {text}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
