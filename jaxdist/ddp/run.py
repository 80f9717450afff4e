"""Data parallelism with gradient buckets, and ZeRO-1 (a distributed optimizer).

`DDP(mesh, ...)` is a value you build and then `prepare` on an unmodified Flax
NNX model, an optax optimizer and a loss function; you get back the sharded
train state and a jitted train step over the mesh axis `dp`.

The state's parameters are the model's parameter tree and the optimizer sees
that tree, so any optax transformation (masks, `multi_transform` by path,
`clip_by_global_norm` in a chain) trains exactly as on one device: the update
runs in global view, outside the per-device program, where XLA adds the
reductions a global norm needs. Flat buckets are communication buffers only.

Plain DDP keeps parameters and optimizer state replicated and all-reduces the
gradients bucket by bucket. With `zero1=True` each parameter is sharded over
the axis along the first dimension the axis size divides (its optimizer
state likewise; 1/dp per device), a bucket's buffer is rank-major (segment r
holds chunk r of each of its parameters, `jaxdist.ddp.buckets`), so the
gradients' reduce-scatter leaves each rank its chunk of every parameter, and
the next step's forward all-gathers the parameters bucket by bucket, each
gather in flight while the previous bucket's layers compute. Parameters no
dimension of which the axis size divides (an odd-sized bias) stay replicated
and are all-reduced, in buckets of their own.

The overlap is data flow, not hooks: the step is traced to a jaxpr and
evaluated equation by equation (`jaxdist.ddp.interleave`). A bucket's reduction
starts right after the equation that finishes its last gradient and is waited
one bucket later; a parameter is read only as the output of the `wait` that
finished its bucket's gather. Everything is ordered on one token chain, so the
order shows in the compiled HLO.

Over an axis of size 1 (one device) nothing moves, and the step is the plain one: value_and_grad of
the loss and the optimizer, without buckets, copies into them or collectives (the same results and
the same state layout, so checkpoints are those of the bucketed step).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist import comm
from jaxdist.compat import model_sharding_dropped
from jaxdist.core.canonical import mirrored_shardings
from jaxdist.core.model_state import ModelState, keep_if, split_for_training
from jaxdist.core.step import (
    PlacedStep,
    TrainState,
    local_batch_avals,
    on_auto_axes,
    on_own_mesh,
    optimizer_step,
    own_mesh,
)
from jaxdist.ddp.bucket_schedule import BucketSchedule
from jaxdist.ddp.buckets import (
    DEFAULT_BUCKET_SIZE,
    BucketLayout,
    bucket_layout,
    unpack_shard,
)
from jaxdist.ddp.canonical import RenamedCanonical
from jaxdist.ddp.interleave import LAZY, eval_interleaved, first_use_order
from jaxdist.ddp.leaf_loss import LeafLoss


@dataclasses.dataclass(frozen=True)
class DDP:
    """Options of data-parallel training over the mesh axis `axis`.

    Attributes:
      mesh: the device mesh; only `axis` is used (other axes see replicated work).
      axis: the data-parallel mesh axis.
      zero1: shard each parameter and its optimizer state over `axis` (along its
        first dimension the axis divides): reduce-scatter gradients, update
        the sharded tree, all-gather parameters in the next forward.
      bucket_size / bucket_bytes / first_bucket_size / pad_for_nccl / shared:
        the bucket layout, see `jaxdist.ddp.buckets.bucket_layout`.
      average_in_collective: True reduces with "mean"; False scales the
        gradients by 1/dp first and reduces with "sum" (Megatron's two choices).
      reduce_dtype: dtype the gradients are reduced in (e.g. float32 for
        bfloat16 parameters), and with accumulation summed over micro-batches
        in where it is wider than the parameters'; default the parameter dtype.
      accumulation_steps: micro-batches per step; only the last one reduces.
        The gradient is the mean over micro-batches (the gradient of the
        whole batch's mean loss), so lr, clipping and `grad_norm` mean the
        same as without accumulation.
      sum_and_count: `loss_fn` returns `(sum, count)` (e.g. of the real tokens
        under a padding mask) instead of a mean: the loss and its gradient are
        the sum over every rank and micro-batch divided by their total count,
        the single-device mean over real tokens (a mean of per-rank means is
        not, when ranks or micro-batches hold different counts).
      skip_nonfinite: when any gradient or the loss is NaN/Inf, keep
        parameters and optimizer state unchanged and report `skipped=True`.
      max_grad_norm: clip the reduced gradient to this global L2 norm (the
        same as `optax.clip_by_global_norm` first in a chain).
      overlap_grad_reduce: start each bucket's reduction during backward.
      overlap_param_gather: (zero1) gather each bucket during the forward,
        just ahead of its first use; otherwise gather everything first.
      pack_buckets: True copies each bucket's parameters into one flat buffer for one
        collective; False starts one grouped collective per bucket over its parameters in
        place, at the same point of the schedule (no copies in or out): one NCCL group with the
        nccl backend; with the xla backend the per-parameter ops start together, for XLA's
        combiners to merge (a bucket's all-reduce compiles to one all-reduce).
      backend: the `jaxdist.comm` backend ("xla" or "nccl"; default: process default).
    """

    mesh: jax.sharding.Mesh
    axis: str = "dp"
    zero1: bool = False
    bucket_size: int | None = DEFAULT_BUCKET_SIZE
    bucket_bytes: int | None = None
    first_bucket_size: int | None = None
    pad_for_nccl: bool = False
    shared: tuple[str, ...] = ()
    average_in_collective: bool = True
    reduce_dtype: Any = None
    accumulation_steps: int = 1
    sum_and_count: bool = False
    skip_nonfinite: bool = True
    max_grad_norm: float | None = None
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    pack_buckets: bool = True
    backend: str | None = None

    def __post_init__(self):
        if self.axis not in self.mesh.axis_names:
            raise ValueError(f"DDP: axis {self.axis!r} is not a mesh axis; the mesh has {self.mesh.axis_names}")
        if not isinstance(self.accumulation_steps, int) or self.accumulation_steps < 1:
            raise ValueError(f"DDP: accumulation_steps must be an int >= 1, got {self.accumulation_steps!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"DDP: max_grad_norm must be positive or None, got {self.max_grad_norm!r}")

    @property
    def dp(self) -> int:
        return self.mesh.shape[self.axis]

    def prepare(
        self,
        model: nnx.Module,
        optimizer: optax.GradientTransformation,
        loss_fn: Callable[[nnx.Module, Any], jax.Array],
        batch,
    ) -> DDPRun:
        """Lay out buckets, shard the state, and build the train step.

        Args:
          model: a Flax NNX module; its `nnx.Param`s are trained. The step runs
            it in train mode; its other variables (dropout RNG streams, batch
            statistics) are the train state's `model_state`: see
            `jaxdist.core.model_state` for how they advance per rank and step.
          optimizer: any optax transformation; it sees the model's parameter
            tree (an `nnx.State`, sharded over `axis` under zero1), as on one device.
          loss_fn: `loss_fn(model, batch) -> scalar` mean loss of a batch (with
            `sum_and_count`, a pair `(sum, count)` of scalars).
          batch: an example global batch (arrays or ShapeDtypeStructs); every
            leaf's leading dimension is the batch and is split over `axis`.
        """
        return DDPRun(self, model, optimizer, loss_fn, batch)


class DDPRun:
    """A prepared DDP run: `state`, `step(state, batch) -> (state, metrics)`, `layout` (the buckets),
    `state_shardings`, `params(state)`, `model(state)` and the canonical conversions."""

    def __init__(self, cfg: DDP, model, optimizer, loss_fn, batch):
        self.cfg = cfg
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.mesh = own_mesh(cfg.mesh)
        self._prepare(model, batch)

    @on_own_mesh  # inside a user's jax.set_mesh too
    def _prepare(self, model, batch):
        cfg = self.cfg
        self.graphdef, params, rest = split_for_training(model, "DDP")
        params, rest = on_auto_axes((params, rest))  # a model built inside a user's jax.set_mesh
        self.model_state = ModelState(rest)
        stored = self.model_state.store(rest)
        self.stored_avals = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), stored)
        leaves, self.treedef = jax.tree.flatten(params)
        self.pure_treedef = jax.tree.structure(nnx.to_pure_dict(params))
        self.param_avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
        self.batch_spec = P(cfg.axis)
        self.micro_batch = self._micro_batch_avals(batch)
        self.leaf_loss = LeafLoss(
            self.graphdef,
            self.treedef,
            self.model_state,
            self.loss_fn,
            cfg.sum_and_count,
            self.param_avals,
            self.stored_avals,
            cfg.reduce_dtype,
        )
        order = first_use_order(self._grad_jaxpr(), {i: i for i in range(len(leaves))})
        self.layout: BucketLayout = bucket_layout(
            params,
            cfg.dp,
            bucket_size=cfg.bucket_size,
            bucket_bytes=cfg.bucket_bytes,
            first_bucket_size=cfg.first_bucket_size,
            forward_order=order,
            shared=cfg.shared,
            pad_for_nccl=cfg.pad_for_nccl,
            rank_major=cfg.zero1,
        )
        self.state_shardings = self._state_shardings()
        self.state = self._init_state(params, stored)
        self.step = PlacedStep(self._step, self._sharding(self.batch_spec), check=self._micro_batch_avals)

    # -- tracing helpers -----------------------------------------------------

    def _micro_batch_avals(self, batch):
        per_step = self.cfg.dp * self.cfg.accumulation_steps
        fix = f"dp * accumulation_steps = {per_step}; change the batch size or accumulation_steps"
        return local_batch_avals(batch, per_step, "DDP", fix)

    def _grad_jaxpr(self, micro_batch=None):
        """The traced gradient (`jaxdist.ddp.leaf_loss.LeafLoss.grad_jaxpr`) of `micro_batch`'s avals
        (default: `prepare`'s example batch's)."""
        return self.leaf_loss.grad_jaxpr(self.micro_batch if micro_batch is None else micro_batch)

    # -- state ---------------------------------------------------------------

    def _sharding(self, spec) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    @functools.cached_property
    def _bucket_of(self) -> dict[int, int]:
        return {s.leaf: b.index for b in self.layout.buckets for s in b.slots}

    @functools.cached_property
    def _leaf_specs(self) -> list[P]:
        """Each parameter's spec: split over the axis along its slot's dimension in a rank-major
        bucket (zero1), else replicated."""
        specs = [P()] * len(self.param_avals)
        for s in (s for b in self.layout.buckets if b.sharded for s in b.slots):
            specs[s.leaf] = P(*[self.cfg.axis if d == s.dim else None for d in range(len(s.shape))])
        return specs

    def _state_shardings(self) -> TrainState:
        """Where the state lives: parameters as `_leaf_specs`, the optimizer state mirroring a parameter
        like it, everything else replicated."""
        params = self.treedef.unflatten(
            [
                jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self._sharding(spec))
                for a, spec in zip(self.param_avals, self._leaf_specs, strict=True)
            ]
        )
        return mirrored_shardings(self.optimizer, params, self.stored_avals, self._sharding(P()))

    def _init_state(self, params, stored) -> TrainState:
        shardings = self.state_shardings
        params = jax.jit(lambda p: p, out_shardings=shardings.params)(params)
        opt_state = jax.jit(self.optimizer.init, out_shardings=shardings.opt_state)(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
        return TrainState(params, opt_state, step, jax.device_put(stored, self._sharding(P())))

    @on_own_mesh
    def params(self, state: TrainState):
        """The full parameters (an `nnx.State`, replicated) of `state`."""
        return self._replicated(state.params)

    @on_own_mesh
    def model(self, state: TrainState) -> nnx.Module:
        """An NNX model (in train mode; call `.eval()` for inference) holding the parameters and the
        model state (e.g. running statistics) of `state`."""
        params, model_state = self._replicated((state.params, state.model_state))
        return nnx.merge(self.graphdef, params, self.model_state.load(model_state))

    @functools.cached_property
    def _replicated(self):
        # one program that every process runs, not a cross-process `device_put` per leaf: independent
        # programs may run concurrently and meet their collectives in another order in each process
        return jax.jit(lambda tree: tree, out_shardings=self._sharding(P()))

    # -- the canonical state (jaxdist.ddp.canonical) --------------------------------

    @functools.cached_property
    def _canonical(self) -> RenamedCanonical:
        return RenamedCanonical(
            self.treedef,
            self.pure_treedef,
            self.param_avals,
            self.stored_avals,
            self.optimizer,
            self.state_shardings,
            self.cfg.mesh,
        )

    @on_own_mesh
    def canonical_shardings(self) -> TrainState:
        """Where the canonical state lives (`jaxdist.ddp.canonical.RenamedCanonical.shardings`)."""
        return self._canonical.shardings()

    @on_own_mesh
    def canonical(self, state: TrainState) -> TrainState:
        """`state` in the canonical form (parameters as the model's pure dict, the optimizer state of
        `optimizer.init` on it), resharded inside jit onto `canonical_shardings()`."""
        return self._canonical.to_canonical_jit(state)

    @on_own_mesh
    def from_canonical(self, tree: TrainState) -> TrainState:
        """This run's state from a canonical one (e.g. restored from a checkpoint of another layout)."""
        return self._canonical.from_canonical_checked(tree)

    @on_own_mesh
    def canonical_target(self) -> TrainState:
        """The canonical state's ShapeDtypeStructs with shardings (what a checkpoint restores onto)."""
        return self._canonical.target()

    def _from_canonical(self, tree: TrainState) -> TrainState:
        """`from_canonical`'s traced conversion (no checks, not jitted): for reading its compiled program."""
        return self._canonical.from_canonical(tree)

    # -- the step ------------------------------------------------------------

    def _step(self, state: TrainState, batch):
        """The gradients of each rank's batch, reduced bucket by bucket inside shard_map (each rank
        gets its chunk of every sharded parameter's gradient); then the optimizer in global view.
        Over an axis of size 1 nothing moves: the gradients come from the plain step (`_plain_grads`),
        without buckets, copies into them or collectives."""
        cfg = self.cfg
        batch = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, self._sharding(self.batch_spec)), batch)
        leaves = self.treedef.flatten_up_to(state.params)
        if cfg.dp == 1:
            grads, model_state, loss, count = self._plain_grads(leaves, state.model_state, state.step, batch)
        else:
            specs = self._leaf_specs
            body = jax.shard_map(
                self._local_grads,
                mesh=self.mesh,
                in_specs=(specs, P(), P(), self.batch_spec),
                out_specs=(specs, P(), P(), P()),
                check_vma=False,
            )
            grads, model_state, loss, count = body(leaves, state.model_state, state.step, batch)
        grads = self.treedef.unflatten(grads)
        if cfg.sum_and_count:  # from the mean over ranks and micro-batches of sums to the sum over the count
            scale = cfg.dp * cfg.accumulation_steps / count
            grads = jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
            loss = loss * scale
        params, opt_state, norm, skipped = optimizer_step(
            self.optimizer,
            state.params,
            state.opt_state,
            grads,
            max_grad_norm=cfg.max_grad_norm,
            skip_nonfinite=cfg.skip_nonfinite,
            loss=loss,
        )
        model_state = keep_if(skipped, model_state, state.model_state)
        params = jax.lax.with_sharding_constraint(params, self.state_shardings.params)
        opt_state = jax.lax.with_sharding_constraint(opt_state, self.state_shardings.opt_state)
        new = TrainState(params, opt_state, state.step + 1, model_state)
        return new, {"loss": loss, "grad_norm": norm, "skipped": skipped}

    @model_sharding_dropped()
    def _plain_grads(self, params: list, model_state, step, batch):
        """`_local_grads` of the only rank (an axis of size 1), as the plain step computes it: the
        gradients in the reduction's dtype, the loss the mean over micro-batches, the count their total.
        A mean over one rank is the value itself, so the result equals the bucketed step's."""
        cfg = self.cfg
        a = cfg.accumulation_steps
        stored = self.model_state.for_step(model_state, jnp.zeros((), jnp.int32), step)
        micro = jax.tree.map(lambda x: x.reshape(a, x.shape[0] // a, *x.shape[1:]), batch)
        grad_fn = self.leaf_loss.grad_fn()
        last = jax.tree.map(lambda x: x[-1], micro)
        loss_sum = count_sum = jnp.zeros((), jnp.float32)
        if a > 1:
            loss_sum, count_sum, acc, stored = self.leaf_loss.accumulate(params, stored, micro)
        (loss, (stored, count)), grads = grad_fn(params, stored, last)
        if a > 1:
            grads = [(g + s) / np.asarray(a, g.dtype) for g, s in zip(grads, acc, strict=True)]
        grads = [g.astype(cfg.reduce_dtype or p.dtype) for g, p in zip(grads, self.param_avals, strict=True)]
        loss = (loss_sum + loss.astype(jnp.float32)) / a
        new_model_state = self.model_state.after_local_step(model_state, stored)
        return grads, new_model_state, loss, count_sum + count

    @model_sharding_dropped()
    def _local_grads(self, params: list, model_state, step, batch):
        """This rank's `(reduced gradient leaves, model state after the step, mean loss, total count)`:
        whole gradients of replicated parameters, this rank's chunk of sharded ones; the loss and the
        gradients are means over ranks and micro-batches (of sums, with `sum_and_count`), the count is
        over every rank and micro-batch."""
        cfg = self.cfg
        tok = comm.token()
        a = cfg.accumulation_steps
        stored = self.model_state.for_step(model_state, jax.lax.axis_index(cfg.axis), step)
        n_stored = len(jax.tree.leaves(stored))
        micro = jax.tree.map(lambda x: x.reshape(a, x.shape[0] // a, *x.shape[1:]), batch)
        # traced for this step's batch, which may differ in size from prepare's example
        closed = self._grad_jaxpr(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), micro))
        n = len(self.param_avals)
        by_bucket = {i: self._bucket_of[i] for i in range(n)}
        gathered = {i: b for i, b in by_bucket.items() if self.layout.buckets[b].sharded}
        gather_first = a > 1 or not cfg.overlap_param_gather
        # gathered just ahead of use, a bucket the forward never reads is never gathered (nor waited for)
        order = first_use_order(closed, gathered, unread=gather_first)
        sched = BucketSchedule(self, tok, params, order, n_stored)
        leaves = list(params)
        if gathered and gather_first:
            for i, x in sched.gather_all().items():
                leaves[i] = x
        else:
            for i in gathered:
                leaves[i] = LAZY
        loss_sum = count_sum = jnp.zeros((), jnp.float32)
        if a > 1:  # no_sync micro-batches: local gradients only, summed; the model state runs on through them
            loss_sum, count_sum, acc, stored = self.leaf_loss.accumulate(leaves, stored, micro)
            sched.accumulated = acc
        last = jax.tree.map(lambda x: x[-1], micro)
        lazy = {i: b for i, b in gathered.items() if leaves[i] is LAZY}
        first_grad = 2 + n_stored  # outputs: loss, model state, count, gradients
        watch = {first_grad + i: b for i, b in by_bucket.items()}
        args = [*leaves, *jax.tree.leaves(stored), *jax.tree.leaves(last)]
        if not cfg.overlap_grad_reduce:
            watch = {}
        loss, *outs = eval_interleaved(closed, args, sched, lazy=lazy, watch=watch)
        stored, count, grads = (
            jax.tree.unflatten(jax.tree.structure(stored), outs[:n_stored]),
            outs[n_stored],
            outs[n_stored + 1 :],
        )
        if not cfg.overlap_grad_reduce:
            for b in range(len(self.layout)):
                sched.ready(b, {first_grad + s.leaf: grads[s.leaf] for s in self.layout.buckets[b].slots})
        reduced = {}
        for bucket, out in zip(self.layout.buckets, sched.drain(), strict=True):
            # packed: the bucket's flat segment (local slices, reshapes, transposes); else per parameter
            reduced.update(unpack_shard(bucket, out, out.dtype) if cfg.pack_buckets else out)
        loss = (loss_sum + loss.astype(jnp.float32)) / a
        loss, tok = comm.all_reduce(loss, cfg.axis, sched.tok, op="mean", backend=cfg.backend)
        if cfg.sum_and_count:
            count, tok = comm.all_reduce(count_sum + count, cfg.axis, tok, op="sum", backend=cfg.backend)
        new_model_state, _ = self.model_state.after_step(model_state, stored, cfg.axis, tok, cfg.backend)
        return [reduced[i] for i in range(n)], new_model_state, loss, count
