"""The `parallel` section as a mesh and a strategy: `make_mesh` lays the devices out, `parallelize`
turns the section into a prepared run (the one place that picks the strategy), `layout_of` records
what a checkpoint was trained with.

tp > 1 gives the unit engine with the model family's TP plan (DP x TP with ZeRO-1 over dp, or
FSDP x TP, HSDP x TP with fsdp > 1), fsdp > 1 alone the engine's ZeRO-3 (HSDP with dp > 1; FSDP with
parallel.update_in_backward), pp > 1 the pipeline, otherwise DDP (ZeRO-1 unless parallel.zero1=false).
cp > 1 adds a context-parallel axis to the unit engine (or the pipeline); its batches are the GPT's
`next_token_batch` layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.models import families
from jaxdist.models.gpt import GPT
from jaxdist.train.config import ConfigError, TrainConfig


def check_backend(cfg: TrainConfig, devices) -> None:
    """Refuse a comm backend these devices cannot run, before any data is prepared or code compiled."""
    backend = cfg.parallel.backend
    if backend not in ("xla", "nccl"):
        raise ConfigError(f"parallel.backend must be xla or nccl, got {backend!r}")
    platforms = sorted({d.platform for d in devices})
    if backend == "nccl" and platforms != ["gpu"]:
        raise ConfigError(
            f"parallel.backend=nccl needs NVIDIA GPUs, but this run's {len(devices)} devices are "
            f"{'/'.join(platforms)}; set parallel.backend=xla"
        )


def make_mesh(cfg: TrainConfig, devices) -> jax.sharding.Mesh:
    p = cfg.parallel
    n = len(devices)
    for name in ("fsdp", "tp", "cp", "pp"):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(p, name)}")
    dp = p.dp if p.dp > 0 else n // (p.fsdp * p.tp * p.cp * p.pp)
    if dp < 1 or dp * p.fsdp * p.tp * p.cp * p.pp != n:
        names = ["dp", "fsdp", "tp"] + [k for k in ("cp", "pp") if getattr(p, k) > 1]
        sizes = " x ".join(str(getattr(p, k)) for k in names)
        raise ConfigError(
            f"parallel.{' x '.join(names)} = {sizes} does not multiply to the {n} devices; "
            f"pick sizes whose product is {n} (dp=-1 fills in the rest)"
        )
    if p.tp > 1 and p.fsdp > 1:
        shape, names = (dp, p.fsdp, p.tp), ("dp", "fsdp", "tp")
    elif p.tp > 1:
        shape, names = (dp, p.tp), ("dp", "tp")
    elif p.fsdp > 1:
        shape, names = (dp, p.fsdp), ("dp", "fsdp")
    else:
        shape, names = (dp,), ("dp",)
    if p.cp > 1:  # inside the data axes, outside tp: tp's collectives are the most frequent
        at = len(shape) - (1 if p.tp > 1 else 0)
        shape, names = (*shape[:at], p.cp, *shape[at:]), (*names[:at], "cp", *names[at:])
    if p.pp > 1:  # the pipeline axis outermost: its neighbours exchange the least
        shape, names = (p.pp, *shape), ("pp", *names)
    return jax.make_mesh(shape, names, devices=devices)


def parallelize(cfg: TrainConfig, mesh, model, optimizer, batch):
    """The strategy the `parallel` section asks for, prepared on `model` (of any family)."""
    from jaxdist.ddp.run import DDP
    from jaxdist.engine.fsdp import FSDP
    from jaxdist.engine.run import Parallel

    p, o = cfg.parallel, cfg.optim
    family = families.family_of(model)
    if p.tp > 1:
        try:
            family.check_tp(model.cfg, p.tp)
        except ValueError as e:
            raise ConfigError(f"parallel.tp={p.tp} cannot split this model: model.{e}") from None
    clip = o.max_grad_norm if o.max_grad_norm > 0 else None
    comm_dtype = _comm_dtype(cfg)
    if o.accumulation_steps > 1 and (p.tp > 1 or p.fsdp > 1):
        raise ConfigError("optim.accumulation_steps > 1 works with DDP only; set it to 1 or use fsdp=tp=1")
    if p.backend not in ("xla", "nccl"):
        raise ConfigError(f"parallel.backend must be xla or nccl, got {p.backend!r}")
    if p.backend == "nccl":
        from jaxdist.comm import nccl

        nccl.init(mesh)
    if p.cp > 1 and not isinstance(model, GPT):
        # the decoders' batches are {"tokens": [B, T + 1]} and their embed takes tokens[:, :-1]: cp needs inputs
        # and targets of one length (the GPT's next_token_batch), which jaxdist's Llama and Gemma do not read yet
        raise ConfigError(
            f"parallel.cp > 1 trains model.family=gpt in the trainer; set parallel.cp=1 for "
            f"{families.family_of(model).name}"  # the model's own (a run.init_from=hf:DIR leaves model.family unset)
        )
    if p.cp > 1 and model.cfg.seq_len % (2 * p.cp):
        raise ConfigError(
            f"model.seq_len={model.cfg.seq_len} must divide into 2 x parallel.cp = {2 * p.cp} equal chunks; "
            "change model.seq_len or parallel.cp"
        )
    if p.pp > 1:
        return _pipelined(cfg, mesh, model, optimizer, batch, clip)
    if p.tp > 1 or p.cp > 1 or (p.fsdp > 1 and not p.update_in_backward):
        # the unit engine: the family's TP plan (tp > 1), then the data axes' storage: ZeRO-3 over fsdp, else
        # ZeRO-1 over dp
        if p.update_in_backward:
            raise ConfigError("parallel.update_in_backward works with FSDP alone (tp=1); set it to false")
        strategy = Parallel(
            mesh,
            plan=family.tp_plan_for(model.cfg) if p.tp > 1 else None,
            zero1=p.zero1,
            sequence_parallel=p.sequence_parallel and p.tp > 1,
            remat=_remat_option(p.remat),
            buffers=p.buffers,
            prefetch=p.buffers - 1,
            compute_dtype=comm_dtype,
            max_grad_norm=clip,
            backend=p.backend,
            pack_units=p.pack_buckets,
        )
        return strategy.prepare(model, optimizer, family.units, batch)
    if p.fsdp > 1:
        dp_axis = "dp" if mesh.shape["dp"] > 1 else None
        strategy = FSDP(
            mesh,
            dp_axis=dp_axis,
            buffers=p.buffers,
            prefetch=p.buffers - 1,
            update_in_backward=p.update_in_backward,
            remat=_remat_option(p.remat),
            compute_dtype=comm_dtype,
            max_grad_norm=None if p.update_in_backward else clip,
            skip_nonfinite=not p.update_in_backward,
            backend=p.backend,
            pack_units=p.pack_buckets,
        )
        return strategy.prepare(model, optimizer, family.units, batch)
    if p.remat is True:  # DDP differentiates the whole loss: it has no blocks to recompute
        raise ConfigError(
            "parallel.remat=true recomputes blocks in FSDP, TP and the pipeline (parallel.fsdp, tp or pp > 1); "
            "DDP keeps every activation: set parallel.remat=auto, or shard with parallel.fsdp"
        )
    strategy = DDP(
        mesh,
        zero1=p.zero1,
        bucket_bytes=int(p.bucket_mb * 2**20),
        pack_buckets=p.pack_buckets,
        accumulation_steps=o.accumulation_steps,
        reduce_dtype=comm_dtype,  # the parameters stay whole in their dtype: ZeRO-1 gathers the master copy
        max_grad_norm=clip,
        backend=p.backend,
    )
    return strategy.prepare(model, optimizer, family.loss, batch)


def _comm_dtype(cfg: TrainConfig) -> np.dtype | None:
    """`parallel.comm_dtype` as the strategies' option: compute is model.dtype (the cast the model makes at
    use, made before the collective instead), param is None (the parameters' own dtype)."""
    return jnp.dtype(cfg.model.dtype) if cfg.parallel.comm_dtype == "compute" else None


def _remat_option(value: bool | str) -> bool | None:
    """`parallel.remat` as the engine's `remat`: "auto" is None (keep activations where the weights are
    kept, recompute under FSDP), true / false force recomputing / keeping."""
    return None if value == "auto" else value  # other values are refused by `config.validate`


def _pipelined(cfg: TrainConfig, mesh, model, optimizer, batch, clip):
    """The pipeline over `pp` (the unit engine's storage and TP plan on the other axes)."""
    from jaxdist.pipeline.run import Pipelined

    p = cfg.parallel
    family = families.family_of(model)
    for key, off in (("update_in_backward", False), ("sequence_parallel", False)):
        if getattr(p, key) != off:
            raise ConfigError(f"parallel.{key} does not work with parallel.pp > 1 yet; set it to {str(off).lower()}")
    if cfg.optim.accumulation_steps > 1:
        raise ConfigError("optim.accumulation_steps > 1 works with DDP only; parallel.microbatches splits a pp step")
    comm_dtype = _comm_dtype(cfg)
    try:
        strategy = Pipelined(
            mesh,
            plan=family.tp_plan_for(model.cfg) if p.tp > 1 else None,
            zero1=p.zero1,
            remat=_remat_option(p.remat),
            compute_dtype=comm_dtype,
            max_grad_norm=clip,
            backend=p.backend,
            pack_units=p.pack_buckets,
            microbatches=p.microbatches,
            schedule=p.schedule,
            virtual=p.virtual,
            per_rank_programs=p.per_rank_programs,
        )
        return strategy.prepare(model, optimizer, family.units, batch)
    except ValueError as e:  # the pipeline's own one-line errors name the parallel.* key to change
        raise ConfigError(f"parallel.pp={p.pp}: {e}") from None


def layout_of(cfg: TrainConfig, mesh) -> dict:
    """The mesh and strategy options a run trains with (recorded with each checkpoint; any layout restores it)."""
    p = cfg.parallel
    keys = ("fsdp", "tp", "cp", "zero1", "bucket_mb", "update_in_backward")
    layout = {"mesh": dict(mesh.shape), **{k: getattr(p, k) for k in keys}, "dtype": cfg.model.dtype}
    if p.fsdp > 1:  # FSDP stores the parameter tree (the unit engine's), no longer flat unit vectors
        layout["storage"] = "parameter tree"
    return layout
