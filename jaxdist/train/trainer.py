"""The trainer: config -> mesh, model, optimizer, strategy, data -> a loop with metrics and checkpoints.

The `parallel` section becomes a mesh and a strategy in `jaxdist.train.strategy` (`parallelize`);
this module runs the loop around it.
"""

from __future__ import annotations

import dataclasses
import functools
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

from jaxdist.models import families
from jaxdist.models.families import FAMILIES
from jaxdist.models.gpt import next_token_batch
from jaxdist.train import hf_init, hooks, memory, peers, run_dir
from jaxdist.train import schedule as schedule_lib
from jaxdist.train.checkpoint import CheckpointError, Checkpoints
from jaxdist.train.config import ConfigError, TrainConfig, validate
from jaxdist.train.decay_mask import adamw, decay_mask
from jaxdist.train.heap import FrozenHeap
from jaxdist.train.launch import initialize_args
from jaxdist.train.loop_guards import NonFiniteLoss as NonFiniteLoss  # where `jaxdist.train.cli` and users catch it
from jaxdist.train.loop_guards import NonFiniteSteps, StopRequests, host_value
from jaxdist.train.loop_output import MetricsLog, Progress, Summary, memory_gb
from jaxdist.train.model_record import check_same_model, model_record
from jaxdist.train.report import info
from jaxdist.train.step_watchdog import StepWatchdog, timeout_from
from jaxdist.train.strategy import check_backend, layout_of, make_mesh, parallelize

# Datasheet dense bf16 peak, FLOP/s, by device kind: the MFU denominator of Megatron, torchtitan
# and MaxText (the H200 has the H100's tensor cores; ~790 TFLOP/s is the best rate measured on it)
PEAK_FLOPS = {
    "NVIDIA H200": 989e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
}


def init_distributed() -> None:
    """Join a multi-process run: `jaxdist launch` sets JAXDIST_COORDINATOR and friends;
    under SLURM or Open MPI, jax.distributed's own detection is used."""
    if os.environ.get("JAXDIST_COORDINATOR"):
        if os.environ.get("JAXDIST_CPU_COLLECTIVES"):
            jax.config.update("jax_cpu_collectives_implementation", os.environ["JAXDIST_CPU_COLLECTIVES"])
        jax.distributed.initialize(**initialize_args(os.environ))
    elif os.environ.get("SLURM_NTASKS", "1") != "1" or os.environ.get("OMPI_COMM_WORLD_SIZE", "1") != "1":
        jax.distributed.initialize(**initialize_args(os.environ))


# the model.* keys that override a flavor's field of the same name, where the family has it
OVERRIDES = ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "seq_len", "vocab_size")


def model_config(cfg: TrainConfig):
    """The model's config: `model.family`'s `model.flavor`, with the model.* keys that are set; or what
    run.init_from=hf:DIR's config.json says (`hf_init.model_of`)."""
    if hf_init.directory(cfg.run.init_from) is not None:
        return hf_init.model_of(cfg).config
    m = cfg.model
    if m.family not in FAMILIES:
        raise ConfigError(f"unknown model.family {m.family!r}; choose one of {', '.join(FAMILIES)}")
    family = FAMILIES[m.family]
    if m.flavor not in family.flavors:
        raise ConfigError(
            f"unknown model.flavor {m.flavor!r} of model.family={m.family}; choose one of {', '.join(family.flavors)}"
        )
    if m.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"model.dtype must be float32 or bfloat16, got {m.dtype!r}")
    fields = {f.name for f in dataclasses.fields(family.config)}
    keys = (*OVERRIDES, "tie_embeddings", "sliding_window", "loss_chunk")
    over = {k: getattr(m, k) for k in keys if getattr(m, k) is not None}
    if "sliding_window" in over:
        over["sliding_window"] = over["sliding_window"] or None  # 0: no window
    for key in over:
        if key not in fields:
            raise ConfigError(f"model.{key} is not a setting of model.family={m.family}; leave it unset")
    try:
        out = dataclasses.replace(family.flavors[m.flavor], **over, dtype=jnp.dtype(m.dtype))
    except ValueError as e:  # the family's own check of its sizes
        raise ConfigError(f"model: {e}") from None
    if m.dtype == "bfloat16" and jax.default_backend() == "gpu":
        out = dataclasses.replace(out, attention="cudnn")  # flash attention
    if m.loss_chunk is not None and (cfg.parallel.tp > 1 or cfg.parallel.pp > 1):
        raise ConfigError(
            "model.loss_chunk works with parallel.tp=1 and pp=1 (under TP the vocabulary-parallel loss never "
            "gathers the logits already); unset model.loss_chunk"
        )
    if m.family == "gpt" and out.d_model % out.n_heads:
        raise ConfigError(f"model.d_model={out.d_model} must be divisible by model.n_heads={out.n_heads}")
    return out


def make_optimizer(cfg: TrainConfig, decay_steps: int | None = None) -> optax.GradientTransformation:
    """AdamW on the warmup + cosine schedule of `decay_steps` steps (default: optim.decay_steps or run.steps),
    decaying the parameters `optim.no_decay` and `optim.decay_vectors` select (`decay_mask`), its first
    moment in `optim.mu_dtype`."""
    o = cfg.optim
    schedule = schedule_lib.make_schedule(o, decay_steps or o.decay_steps or cfg.run.steps)
    mask = decay_mask(o.no_decay, o.decay_vectors)
    mu_dtype = None if o.mu_dtype == "float32" else jnp.dtype(o.mu_dtype)  # None: the parameters' dtype
    return adamw(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, mask=mask, mu_dtype=mu_dtype), schedule


def _next_token_batches(sharding):
    """The loader's batches in `next_token_batch`'s layout, on `sharding` (one small program per step)."""
    return jax.jit(next_token_batch, out_shardings=sharding)


def flops_per_token(m) -> float:
    """6 N (matmuls, forward and backward) + 12 L (heads x head_dim) T (attention scores and values), per token."""
    return families.family_of(m).flops_per_token(m)


def _fetch_ahead(values) -> None:
    """Start copying these (small) arrays to the host now. A checkpoint's host copies, enqueued next, go
    through the same device-to-host queue: a read of a loss behind them waited for the whole state
    (~70 ms for GPT-124M on an H200)."""
    for x in jax.tree.leaves(values):
        if isinstance(x, jax.Array) and x.is_fully_addressable:
            x.copy_to_host_async()


def train(cfg: TrainConfig, *, stop_after: int | None = None) -> list[float]:
    """Run the configured training; returns the loss of every step run.

    `stop_after` ends the run early after that many steps (as an interruption
    would), saving a checkpoint: used to test resuming.
    """
    validate(cfg)
    init_distributed()
    peers.check_same_config(cfg.to_dict())  # (as given: relative paths may resolve otherwise on each node)
    hf_init.make_absolute(cfg)
    hf_init.use_tokenizer(cfg)  # run.init_from=hf:DIR: its tokenizer.json tokenizes text data
    devices = jax.devices()
    check_backend(cfg, devices)
    mesh = make_mesh(cfg, devices)
    mcfg = model_config(cfg)
    heap = FrozenHeap()
    with run_dir.prepared(cfg.run) as out_dir:  # locked until the run ends: one trainer per run directory
        losses = _train(cfg, stop_after, devices, mesh, mcfg, out_dir, heap)
    # the caller's own frozen objects frozen again, now that the loop's objects are gone (not after an
    # exception: its traceback holds them, and a freeze would keep their garbage for good)
    heap.restore()
    return losses


def _train(
    cfg: TrainConfig, stop_after: int | None, devices, mesh, mcfg, out_dir: Path, heap: FrozenHeap
) -> list[float]:
    """`train` in the locked run directory `out_dir`."""
    source = hooks.source(cfg, "train", mcfg, out_dir)
    hooks.check_sample_prompt(cfg, mcfg, source)
    batch_axes = tuple(n for n in mesh.axis_names if n not in ("tp", "pp", "cp"))  # cp splits sequences, not rows
    batch_sharding = NamedSharding(mesh, P(batch_axes))
    n_batch = int(np.prod([mesh.shape[a] for a in batch_axes])) * cfg.optim.accumulation_steps
    if cfg.data.batch_size % n_batch:
        raise ConfigError(
            f"data.batch_size={cfg.data.batch_size} is not divisible by the {n_batch} data-parallel ranks"
            f"{' x accumulation steps' if cfg.optim.accumulation_steps > 1 else ''}; pick a multiple of {n_batch}"
        )

    model_meta = model_record(families.record(mcfg))  # the GPT's without a family, as it always was
    layout = layout_of(cfg, mesh)
    keep, compress = cfg.run.keep_checkpoints, cfg.run.checkpoint_compress
    ckpt = Checkpoints(out_dir, keep, compress=compress) if cfg.run.checkpoint_every >= 0 else None

    start, meta = 0, None
    found = _newest_meta(ckpt, model_meta, cfg.optim.mu_dtype) if (ckpt and cfg.run.resume) else None
    if found is not None:
        start, meta = found
        hooks.check_same_data(meta, source)

    model = families.family_of(mcfg).model(mcfg, nnx.Rngs(cfg.run.seed))
    from_hf = hf_init.directory(cfg.run.init_from) is not None and found is None
    if cfg.run.init_from and found is None and not from_hf:  # a resumed run reads its own checkpoint, below
        from jaxdist.train.export import load_params

        nnx.update(model, load_params(cfg.run.init_from, nnx.state(model, nnx.Param)))
    # host copies: every process passes the same values, which is what a multi-process jit needs
    nnx.update(model, jax.tree.map(np.asarray, nnx.state(model)))
    loader = hooks.Loader(source, cfg.data.batch_size, batch_sharding)
    example = {"tokens": np.zeros(loader.shape, np.int32)}
    if cfg.parallel.cp > 1:  # inputs and targets of one length, which cp cuts along the sequence
        example = next_token_batch(example)
    evaluator = hooks.evaluator(cfg, mcfg, out_dir, batch_sharding)
    decay_steps = schedule_lib.decay_steps(cfg, meta, start)
    optimizer, schedule = make_optimizer(cfg, decay_steps)
    run = parallelize(cfg, mesh, model, optimizer, example)
    state = hf_init.load_state(run, optimizer, mcfg, cfg.run.init_from) if from_hf else run.state
    if found is not None:
        start, (state, meta) = _restore_state(ckpt, start, run, model_meta, cfg.optim.mu_dtype)
        saved_in = meta.get("layout")
        moved = f" (saved in layout {saved_in}, converted to {layout})" if saved_in != layout else ""
        info(f"resumed from {ckpt.directory} at step {start}{moved}")
        if start >= cfg.run.steps:
            info(f"the run already has its {cfg.run.steps} steps; raise run.steps to train further")

    if cfg.run.steps > start and hasattr(run.step, "compile"):  # (a step wrapped by a caller has none)
        # compiled now, the executable the loop runs: refused here if it cannot fit
        compiled = run.step.compile(state, example)
        memory.check_fits(compiled.memory_analysis(), jax.local_devices()[0], jax.local_device_count())
    # the checkpoint conversion compiled and the host copy's memory taken in the first step's window (which
    # compiles anyway), not at the loop's first save: after that step, whose outputs are what the saves see
    # (their shardings may be spelled otherwise than the initial state's, which would compile it again)
    warm_saves = ckpt is not None and cfg.run.checkpoint_every > 0 and cfg.run.steps > start

    log = MetricsLog(out_dir, cfg.run.tensorboard, start)
    peak = PEAK_FLOPS.get(jax.local_devices()[0].device_kind) if mcfg.dtype == jnp.bfloat16 else None
    tokens_per_step = cfg.data.batch_size * mcfg.seq_len
    flops_step = flops_per_token(mcfg) * tokens_per_step
    end = cfg.run.steps if stop_after is None else min(cfg.run.steps, start + stop_after)
    bar = Progress(cfg, start, end)
    losses: list[float] = []
    pending: list = []
    due: list = []  # the save and row of the step before the newest, done once the newest is queued
    meta_out = {
        "model": model_meta,
        "layout": layout,
        "config": cfg.to_dict(),
        "schedule": {"decay_steps": decay_steps},
        "data": source.state(),
    }

    held = {"window": 0.0, "run": 0.0, "saves": 0}  # seconds the loop waited in checkpoint saves
    # the first row, save and evaluation create long-lived objects (their programs, orbax's handlers): the
    # heap is frozen again after each, so that full collections in the loop do not visit them
    refreeze = {"due": False, "evaluated": False}

    def save(step: int, in_loop: bool = True, read_next=()):
        finish = stage_save(step, in_loop, read_next)
        if finish is not None:
            finish()

    def stage_save(step: int, in_loop: bool = True, read_next=()):
        """Enqueue the copies of the state saved as `step` and return what finishes the save (the NaN/Inf
        check, then the write in the background); None if `step` is not saved."""
        # only steps this invocation trained: a resumed run has its start step already (a finished run
        # given a smaller run.steps would otherwise save its newest state under the smaller step's name)
        if ckpt is None or step <= start or step == ckpt.latest():
            skips.check()
            return None
        # the conversion and the host copies are enqueued first, while the device still runs the queued
        # steps; then the check waits for those steps: a state they stopped the run for (NaN/Inf) is never saved
        _fetch_ahead((skips.pending, read_next))  # what the loop reads next (the check, the log row)
        began = time.perf_counter()
        staged = ckpt.stage(run.canonical(state))
        staged_s = time.perf_counter() - began

        def finish():
            if ckpt.latest() == step:  # run again after an interrupt cut it: its save had started
                return
            began = time.perf_counter()
            skips.check()
            samples = first_sample + (step - start) * cfg.data.batch_size  # where the data stream continues
            ckpt.save(step, staged, {**meta_out, "step": step, "data_samples": samples})
            waited = staged_s + time.perf_counter() - began
            held["window"] += waited
            held["saves"] += 1
            if held["saves"] == 1:
                refreeze["due"] = True
            # as the mean tokens/s: the loop's windows after the first; the first save also compiles
            held["run"] += waited if in_loop and held["saves"] > 1 else 0.0

        return finish

    def log_row(step: int, losses_read: list, metrics: dict, evaluate: bool) -> None:
        """The metrics row of `step + 1` (its losses `losses_read`, its metrics), once those are on the host;
        nothing if that row is written already (run again after an interrupt cut it)."""
        nonlocal window_start, window_tokens
        if step + 1 <= rows["through"]:
            return
        losses.extend(float(host_value(x)) for x in losses_read)
        skips.check()
        jax.block_until_ready(metrics)
        elapsed = time.perf_counter() - window_start
        tps = window_tokens / elapsed
        mfu = tps / tokens_per_step * flops_step / (peak * len(devices)) if peak else None
        row = {
            "step": step + 1,
            "loss": losses[-1],
            # the schedule counts the updates applied: a skipped step does not advance it (as in Megatron-LM)
            "lr": _host_lr(schedule, step - skipped_at_start - skips.skipped_before(step + 1)),
            "grad_norm": float(host_value(metrics["grad_norm"])) if _has_grad_norm(cfg, metrics) else None,
            "tokens_per_s": tps,
            "mfu": mfu,
            "mem_gb": memory_gb(jax.local_devices()[0]),
            "skipped": bool(host_value(metrics["skipped"])) if "skipped" in metrics else False,
            # the previous save still writing, then enqueuing the host copies (in this window's time)
            "checkpoint_s": held["window"] if ckpt is not None and cfg.run.checkpoint_every > 0 else None,
            "includes_compile": True if step == start else None,  # its tokens_per_s is not the run's pace
        }
        if evaluate:
            row["val_loss"] = evaluator(run.model(state))
            if not refreeze["evaluated"]:
                refreeze.update(due=True, evaluated=True)
        row = {k: v for k, v in row.items() if v is not None}  # a metric not computed is left out
        summary.add(row, window_tokens, elapsed)
        held["window"] = 0.0
        log.write(row)
        rows["through"] = step + 1
        guard.record(row)
        bar.update(step + 1, row)
        window_start, window_tokens = time.perf_counter(), 0

    def run_due(works: list) -> None:
        """Run each of `works` and take it off the list once done: one an interrupt cuts stays, to run again."""
        while works:
            works[0]()
            works.pop(0)

    step = stepped = start  # stepped: the steps whose state and metrics the loop holds
    rows = {"through": start}  # the last step with its row written
    summary = Summary()
    window_start, window_tokens = time.perf_counter(), 0
    guard = StepWatchdog(timeout_from(cfg.run.step_timeout_s), out_dir, process_index=jax.process_index())
    # the data's state is the step (see jaxdist.train.data.shards) and the samples read before it: a resume with
    # another data.batch_size continues the stream at the next sample, skipping and repeating none
    first_sample = hooks.samples_before(meta, start, cfg.data.batch_size)
    batches = loader.batches(start, offset=first_sample - start * cfg.data.batch_size)
    if cfg.parallel.cp > 1:
        batches = map(_next_token_batches(batch_sharding), batches)
    stop = StopRequests()
    skips = NonFiniteSteps(cfg, ckpt)
    skipped_at_start = start - _updates_applied(state.opt_state, start)
    try:
        for step in range(start, end):
            guard.beat(step)  # a step (or the log/checkpoint work after it) past the deadline ends the run
            state, metrics, stepped = *run.step(state, next(batches)), step + 1  # one assignment: no interrupt between
            if step == start:
                heap.freeze()  # the compiled programs and the model exist now: full collections skip them
            if warm_saves:
                warm_saves = False
                ckpt.warm_up(run.canonical(state))
            run_due(due)  # the previous step's save and row: done or nearly, and this step queued behind it
            skips.add(step + 1, metrics)
            pending.append(metrics["loss"])  # read back only when logging: no host sync per step
            window_tokens += tokens_per_step
            last = step + 1 == end
            evaluate = evaluator is not None and ((step + 1) % cfg.run.eval_every == 0 or last)
            logged = (step + 1) % max(1, cfg.run.log_every) == 0 or last or step == start or evaluate
            # a save's check and a row wait for this step: done after the next step is queued, so that the device
            # never idles while the host does them (an evaluation reads this state, which the next step donates)
            later = not (last or evaluate or step == start)
            saved = ckpt and cfg.run.checkpoint_every > 0 and (step + 1) % cfg.run.checkpoint_every == 0 and not last
            # the save first: its copies are enqueued before the row's wait, and the row counts its time
            finish_save = stage_save(step + 1, read_next=(pending, metrics)) if saved else None
            row = functools.partial(log_row, step, pending, metrics, evaluate) if logged else None
            if logged:
                pending = []
            due = [work for work in (finish_save, row) if work is not None]
            if not later:
                run_due(due)
            if step == start or refreeze["due"]:
                refreeze["due"] = False
                heap.freeze()
            stop.check()
        stop.at_end()
        save(end, in_loop=False)
        summary.print(out_dir, ckpt, held["run"])
        if cfg.run.sample_tokens > 0 and end > start:
            hooks.print_sample(cfg, run.model(state), source)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (a scheduler's stop): see StopRequests
        run_due(due)  # the last finished step's save and row
        # the state after the last finished step: a checkpoint of it (and the one in flight), then stop
        if any(x.is_deleted() for x in jax.tree.leaves(state)):  # inside a step that took (donated) it
            print("\njaxdist: interrupted inside a step; the newest checkpoint is the one to resume from")
        elif ckpt is not None:
            done = int(host_value(state.step))  # the state's own count: the interrupt may precede the loop's
            print(f"\njaxdist: interrupted; saving step {done}")
            save(done)
        row_due = stepped % max(1, cfg.run.log_every) == 0 or stepped == start + 1
        if stepped > rows["through"] and row_due:  # a second Ctrl-C before the newest step's row was due
            log_row(stepped - 1, [metrics["loss"]], metrics, evaluate=False)
        raise
    finally:
        heap.release()
        guard.close()
        bar.close()
        log.close()
        try:
            if ckpt:
                ckpt.close()  # with the stop handlers still in place: a SIGTERM now must not cut the last save
        finally:
            stop.close()
    return losses


def _updates_applied(opt_state, default: int) -> int:
    """The optimizer's count of updates applied (optax's `count`, which its schedule reads), else `default`."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        name = getattr(path[-1], "name", None) if path else None
        if name == "count" and jnp.issubdtype(leaf.dtype, jnp.integer) and leaf.size == 1:
            return int(host_value(leaf).reshape(()))
    return default


def _host_lr(schedule, step: int) -> float:
    """The learning rate of `step`, computed on the CPU: on the accelerator it would queue behind the next
    step, which the loop has queued already, and wait for it."""
    with jax.default_device(jax.local_devices(backend="cpu")[0]):  # this process's own, with several
        return float(schedule(step))


def _has_grad_norm(cfg: TrainConfig, metrics: dict) -> bool:
    """FSDP's update_in_backward updates each unit before the global gradient norm exists."""
    return "grad_norm" in metrics and not (cfg.parallel.fsdp > 1 and cfg.parallel.update_in_backward)


def _newest_meta(ckpt: Checkpoints, model_meta: dict, mu_dtype: str):
    """(step, meta) of the newest readable checkpoint of this model."""

    def read(step: int):
        meta = ckpt.meta(step)
        check_same_model(meta, model_meta, ckpt.directory)
        check_same_moment_dtype(meta, mu_dtype, ckpt.directory)
        return meta

    had_checkpoints = bool(ckpt.manager.all_steps())
    found = ckpt.newest_readable(read)
    if found is None and had_checkpoints:  # starting over would replace the run: as run_dir refuses it
        raise CheckpointError(
            f"no readable checkpoint left in {ckpt.directory} (each moved to {ckpt.unreadable_dir}); "
            f"set run.overwrite=true to start over (it keeps {ckpt.unreadable_dir.name}/)"
        )
    return found


def check_same_moment_dtype(meta: dict, mu_dtype: str, directory: Path) -> None:
    """Refuse a resume whose `optim.mu_dtype` is not the checkpoint's (a config change, not a damaged
    checkpoint: the restore would find every first moment of another dtype). Older checkpoints' is float32."""
    saved = ((meta.get("config") or {}).get("optim") or {}).get("mu_dtype", "float32")
    if saved != mu_dtype:
        run_dir = Path(directory).parent
        raise ConfigError(
            f"the checkpoint in {directory} keeps AdamW's first moment in {saved}, this run asks for "
            f"optim.mu_dtype={mu_dtype}; set optim.mu_dtype={saved} to resume it, or start a new run from its "
            f"parameters (`jaxdist export {run_dir} OUT`, then run.init_from=OUT with a new run.out_dir)"
        )


def _restore_state(ckpt: Checkpoints, start: int, run, model_meta: dict, mu_dtype: str):
    """(step, (state, metadata)) of the newest checkpoint at or before `start` that restores: its canonical
    state read into this run's canonical shardings, converted to the run's own layout (any layout saved it)."""

    def read(step: int):
        meta = ckpt.meta(step)
        check_same_model(meta, model_meta, ckpt.directory)
        check_same_moment_dtype(meta, mu_dtype, ckpt.directory)
        return run.from_canonical(ckpt.restore(step, run.canonical_target())), meta

    found = ckpt.newest_readable(read, below=start + 1)
    if found is None:
        raise CheckpointError(f"no readable checkpoint left in {ckpt.directory}; set run.overwrite=true to start over")
    return found
