"""Data parallelism with gradient buckets, and ZeRO-1 (a distributed optimizer).

`DDP(mesh, ...)` is a value you build and then `prepare` on an unmodified Flax
NNX model, an optax optimizer and a loss function; you get back the sharded
train state and a jitted train step over the mesh axis `dp`.

Plain DDP keeps parameters and optimizer state replicated and all-reduces the
gradients bucket by bucket. With `zero1=True` the state is the parameters'
bucket shards and the optimizer state of those shards (1/dp per device); the
gradients are reduce-scattered, each rank updates its shard, and the next
step's forward all-gathers the parameters bucket by bucket, each gather in
flight while the previous bucket's layers compute.

The overlap is data flow, not hooks: the step is traced to a jaxpr and
evaluated equation by equation (`jaxdist._interleave`). A bucket's reduction
starts right after the equation that finishes its last gradient and is waited
one bucket later; a parameter is read only as the output of the `wait` that
finished its bucket's gather. Everything is ordered on one token chain, so the
order shows in the compiled HLO.
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
from jaxdist._interleave import LAZY, Schedule, eval_interleaved, first_use_order
from jaxdist._step import TrainState, local_batch_avals, sharded_step
from jaxdist.buckets import DEFAULT_BUCKET_SIZE, BucketLayout, bucket_layout, pack_bucket, unpack_bucket
from jaxdist.canonical import (
    canonical_avals,
    check_canonical,
    mirror_map,
    resharding,
    split_largest_dim,
    with_shardings,
)
from jaxdist.model_state import ModelState, keep_if, split_for_training


@dataclasses.dataclass(frozen=True)
class DDP:
    """Options of data-parallel training over the mesh axis `axis`.

    Attributes:
      mesh: the device mesh; only `axis` is used (other axes see replicated work).
      axis: the data-parallel mesh axis.
      zero1: shard the optimizer state (and the parameters between steps) over
        `axis`: reduce-scatter gradients, update shards, all-gather parameters.
      bucket_size / bucket_bytes / first_bucket_size / pad_for_nccl / shared:
        the bucket layout, see `jaxdist.buckets.bucket_layout`.
      average_in_collective: True reduces with "mean"; False scales the
        gradients by 1/dp first and reduces with "sum" (Megatron's two choices).
      reduce_dtype: dtype the gradients are reduced in (e.g. float32 for
        bfloat16 parameters); default the parameter dtype.
      accumulation_steps: micro-batches per step; only the last one reduces.
        The gradient is the mean over micro-batches (the gradient of the
        whole batch's mean loss), so lr, clipping and `grad_norm` mean the
        same as without accumulation.
      skip_nonfinite: when any gradient is NaN/Inf, keep parameters and
        optimizer state unchanged and report `skipped=True`.
      max_grad_norm: clip the reduced gradient to this global L2 norm (exact
        under zero1 too, unlike an optax clip applied to shards).
      overlap_grad_reduce: start each bucket's reduction during backward.
      overlap_param_gather: (zero1) gather each bucket during the forward,
        just ahead of its first use; otherwise gather everything first.
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
    skip_nonfinite: bool = True
    max_grad_norm: float | None = None
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
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
            `jaxdist.model_state` for how they advance per rank and step.
          optimizer: an optax transformation. Under zero1 it sees each bucket's
            flat shard as one leaf, so it must be elementwise (adam, adamw
            without a mask, sgd, lion, ...); use `max_grad_norm` for clipping.
          loss_fn: `loss_fn(model, batch) -> scalar` mean loss of a batch.
          batch: an example global batch (arrays or ShapeDtypeStructs); every
            leaf's leading dimension is the batch and is split over `axis`.
        """
        return DDPRun(self, model, optimizer, loss_fn, batch)


class DDPRun:
    """A prepared DDP run: `state`, `step(state, batch) -> (state, metrics)`, `layout`."""

    def __init__(self, cfg: DDP, model, optimizer, loss_fn, batch):
        self.cfg = cfg
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.graphdef, params, rest = split_for_training(model)
        self.model_state = ModelState(rest)
        stored = self.model_state.store(rest)
        self.stored_avals = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), stored)
        leaves, self.treedef = jax.tree.flatten(params)
        self.pure_treedef = jax.tree.structure(nnx.to_pure_dict(params))
        self.param_avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
        self.batch_spec = P(cfg.axis)
        self.micro_batch = self._micro_batch_avals(batch)
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
        )
        self.state = self._init_state(params, stored)
        self.step = jax.jit(self._step, donate_argnums=0)

    # -- tracing helpers -----------------------------------------------------

    def _micro_batch_avals(self, batch):
        per_step = self.cfg.dp * self.cfg.accumulation_steps
        fix = f"dp * accumulation_steps = {per_step}; change the batch size or accumulation_steps"
        return local_batch_avals(batch, per_step, "DDP", fix)

    def _loss_of_leaves(self, leaves, stored, batch):
        """`(loss, model state after the forward)` of one micro-batch."""
        params = self.treedef.unflatten(leaves)
        return self.model_state.apply(self.graphdef, params, stored, lambda model: self.loss_fn(model, batch))

    def _grad_fn(self):
        return jax.value_and_grad(self._loss_of_leaves, has_aux=True)

    def _grad_jaxpr(self):
        """Inputs: parameter leaves, model state leaves, batch leaves; outputs: loss, model state, gradients."""
        return jax.make_jaxpr(self._grad_fn())(self.param_avals, self.stored_avals, self.micro_batch)

    # -- state ---------------------------------------------------------------

    def _sharding(self, spec) -> NamedSharding:
        return NamedSharding(self.cfg.mesh, spec)

    def _init_state(self, params, stored) -> TrainState:
        leaves = self.treedef.flatten_up_to(params)
        if self.cfg.zero1:
            shard = self._sharding(P(self.cfg.axis))
            pack_all = jax.jit(lambda ls: tuple(pack_bucket(b, ls) for b in self.layout.buckets), out_shardings=shard)
            state_params = pack_all(leaves)
        else:
            state_params = jax.device_put(params, self._sharding(P()))
        opt_state = jax.jit(self.optimizer.init, out_shardings=self._opt_shardings(state_params))(state_params)
        step = jax.device_put(jnp.zeros((), jnp.int32), self._sharding(P()))
        return TrainState(state_params, opt_state, step, jax.device_put(stored, self._sharding(P())))

    def _opt_specs(self, params):
        """Under zero1 every non-scalar optimizer leaf is a bucket shard; everything else is replicated."""
        shapes = jax.eval_shape(self.optimizer.init, params)
        split = self.cfg.zero1
        return jax.tree.map(lambda s: P(self.cfg.axis) if split and s.ndim >= 1 else P(), shapes)

    def _opt_shardings(self, params):
        return jax.tree.map(self._sharding, self._opt_specs(params), is_leaf=lambda x: isinstance(x, P))

    def params(self, state: TrainState):
        """The full parameters (an `nnx.State`, replicated) of `state`."""
        if not self.cfg.zero1:
            return state.params
        full = jax.device_put(state.params, self._sharding(P()))
        leaves = {}
        for bucket, flat in zip(self.layout.buckets, full, strict=True):
            leaves.update(unpack_bucket(bucket, flat))
        return self.treedef.unflatten([leaves[i] for i in range(len(leaves))])

    def model(self, state: TrainState) -> nnx.Module:
        """An NNX model (in train mode; call `.eval()` for inference) holding the parameters and the
        model state (e.g. running statistics) of `state`."""
        rest = self.model_state.load(jax.device_put(state.model_state, self._sharding(P())))
        return nnx.merge(self.graphdef, self.params(state), rest)

    # -- the canonical state (jaxdist.canonical) ------------------------------

    def canonical_shardings(self) -> TrainState:
        """Where the canonical state lives: under zero1 each parameter (and its optimizer state) split over
        the axis along its largest dimension that divides, so no device holds a whole copy; else replicated."""
        avals = self._canonical_avals()
        replicated = self._sharding(P())
        split = lambda a: split_largest_dim(a.shape, self.cfg.mesh, self.cfg.axis if self.cfg.zero1 else None)
        params = jax.tree.map(split, avals.params)
        placed = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), avals.params, params)
        opt = mirror_map(avals.opt_state, placed, lambda _, p: p.sharding, lambda _: replicated)
        return TrainState(params, opt, replicated, jax.tree.map(lambda _: replicated, avals.model_state))

    def _canonical_avals(self) -> TrainState:
        return canonical_avals(self.optimizer, self.pure_treedef.unflatten(self.param_avals), self.stored_avals)

    def canonical(self, state: TrainState) -> TrainState:
        """`state` in the canonical form (parameters as the model's pure dict, the optimizer state of
        `optimizer.init` on it), resharded inside jit onto `canonical_shardings()`."""
        return resharding(self._to_canonical, self.cfg.mesh, self.canonical_shardings())(state)

    def from_canonical(self, tree: TrainState) -> TrainState:
        """This run's state from a canonical one (e.g. restored from a checkpoint of another layout)."""
        check_canonical(tree, self._canonical_avals(), "DDP")
        return resharding(self._from_canonical, self.cfg.mesh, self._state_shardings())(tree)

    def canonical_target(self) -> TrainState:
        """The canonical state's ShapeDtypeStructs with shardings (what a checkpoint restores onto)."""
        return with_shardings(self._canonical_avals(), self.canonical_shardings())

    def _state_shardings(self) -> TrainState:
        replicated = self._sharding(P())
        if self.cfg.zero1:
            params = tuple(jax.ShapeDtypeStruct((b.size,), b.dtype) for b in self.layout.buckets)
        else:
            params = self.treedef.unflatten(self.param_avals)
        params_sharding = jax.tree.map(lambda _: self._sharding(P(self.cfg.axis) if self.cfg.zero1 else P()), params)
        model_state = jax.tree.map(lambda _: replicated, self.stored_avals)
        return TrainState(params_sharding, self._opt_shardings(params), replicated, model_state)

    def _to_canonical(self, state: TrainState) -> TrainState:
        if self.cfg.zero1:
            params = self._unpack(state.params)
            opt = optax.tree_utils.tree_map_params(
                self.optimizer, self._unpack, state.opt_state, is_leaf=lambda v: isinstance(v, tuple)
            )
        else:
            params = self.pure_treedef.unflatten(jax.tree.leaves(state.params))
            opt = jax.tree.structure(self._canonical_avals().opt_state).unflatten(jax.tree.leaves(state.opt_state))
        return TrainState(params, opt, state.step, state.model_state)

    def _from_canonical(self, tree: TrainState) -> TrainState:
        if self.cfg.zero1:
            params = self._pack(tree.params)
            opt = optax.tree_utils.tree_map_params(
                self.optimizer, self._pack, tree.opt_state, is_leaf=lambda v: isinstance(v, dict)
            )
        else:
            params = self.treedef.unflatten(jax.tree.leaves(tree.params))
            own = jax.eval_shape(self.optimizer.init, params)
            opt = jax.tree.structure(own).unflatten(jax.tree.leaves(tree.opt_state))
        return TrainState(params, opt, tree.step, tree.model_state)

    def _unpack(self, flats) -> dict:
        """A pure parameter dict from one flat buffer per bucket (parameters, or optimizer moments in
        their own dtype)."""
        leaves = {}
        for bucket, flat in zip(self.layout.buckets, flats, strict=True):
            leaves.update(unpack_bucket(bucket, flat, flat.dtype))
        return self.pure_treedef.unflatten([leaves[i] for i in range(len(leaves))])

    def _pack(self, pure: dict) -> tuple:
        leaves = self.pure_treedef.flatten_up_to(pure)
        return tuple(pack_bucket(b, leaves, leaves[b.slots[0].leaf].dtype) for b in self.layout.buckets)

    # -- the step ------------------------------------------------------------

    def _step(self, state: TrainState, batch):
        cfg = self.cfg
        return sharded_step(
            self._local_step,
            cfg.mesh,
            state,
            batch,
            param_specs=P(cfg.axis) if cfg.zero1 else P(),
            opt_specs=self._opt_specs(state.params),
            batch_spec=self.batch_spec,
            metrics=("loss", "grad_norm", "skipped"),
        )

    def _local_step(self, params, opt_state, model_state, step, batch):
        cfg = self.cfg
        tok = comm.token()
        a = cfg.accumulation_steps
        stored = self.model_state.for_step(model_state, jax.lax.axis_index(cfg.axis), step)
        n_stored = len(jax.tree.leaves(stored))
        micro = jax.tree.map(lambda x: x.reshape(a, x.shape[0] // a, *x.shape[1:]), batch)
        closed = self._grad_jaxpr()
        n = len(self.param_avals)
        by_bucket = {i: self._bucket_of[i] for i in range(n)}
        sched = _BucketSchedule(self, tok, params if cfg.zero1 else None, first_use_order(closed, by_bucket), n_stored)
        if cfg.zero1 and (a > 1 or not cfg.overlap_param_gather):
            leaves = sched.gather_all()
        elif cfg.zero1:
            leaves = [LAZY] * n
        else:
            leaves = self.treedef.flatten_up_to(params)
        loss_sum = jnp.zeros((), jnp.float32)
        if a > 1:  # no_sync micro-batches: local gradients only, summed; the model state runs on through them
            grad_fn = self._grad_fn()

            def accumulate(carry, mb):
                loss_sum, acc, stored = carry
                (loss, stored), grads = grad_fn(leaves, stored, mb)
                return (loss_sum + loss, [g + d for g, d in zip(acc, grads, strict=True)], stored), None

            zeros = [jnp.zeros(x.shape, x.dtype) for x in self.param_avals]
            first = jax.tree.map(lambda x: x[:-1], micro)
            (loss_sum, acc, stored), _ = jax.lax.scan(accumulate, (loss_sum, zeros, stored), first)
            sched.accumulated = acc
        last = jax.tree.map(lambda x: x[-1], micro)
        lazy = by_bucket if leaves[0] is LAZY else {}
        first_grad = 1 + n_stored  # outputs: loss, model state, gradients
        watch = {first_grad + i: b for i, b in by_bucket.items()}
        args = [*leaves, *jax.tree.leaves(stored), *jax.tree.leaves(last)]
        if not cfg.overlap_grad_reduce:
            watch = {}
        loss, *outs = eval_interleaved(closed, args, sched, lazy=lazy, watch=watch)
        stored, grads = jax.tree.unflatten(jax.tree.structure(stored), outs[:n_stored]), outs[n_stored:]
        if not cfg.overlap_grad_reduce:
            for b in range(len(self.layout)):
                sched.ready(b, {first_grad + s.leaf: grads[s.leaf] for s in self.layout.buckets[b].slots})
        reduced = sched.drain()
        loss = (loss_sum + loss.astype(jnp.float32)) / a
        loss, tok = comm.all_reduce(loss, cfg.axis, sched.tok, op="mean", backend=cfg.backend)
        new_model_state, tok = self.model_state.after_step(model_state, stored, cfg.axis, tok, cfg.backend)
        new_params, new_opt, metrics = self._update(params, opt_state, reduced, loss, tok)
        return new_params, new_opt, keep_if(metrics["skipped"], new_model_state, model_state), metrics

    @functools.cached_property
    def _bucket_of(self) -> dict[int, int]:
        return {s.leaf: b.index for b in self.layout.buckets for s in b.slots}

    def _update(self, params, opt_state, reduced: list, loss, tok):
        cfg = self.cfg
        sq = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in reduced)
        if cfg.zero1:  # each rank holds a shard: the global norm needs the other ranks' squares
            sq, tok = comm.all_reduce(sq, cfg.axis, tok, op="sum", backend=cfg.backend)
        norm = jnp.sqrt(sq)
        if cfg.max_grad_norm is not None:
            scale = jnp.minimum(1.0, cfg.max_grad_norm / (norm + 1e-6))
            reduced = [(g * scale).astype(g.dtype) for g in reduced]
        if cfg.zero1:
            grads = tuple(g.astype(b.dtype) for g, b in zip(reduced, self.layout.buckets, strict=True))
        else:
            unpacked = {}
            for bucket, flat in zip(self.layout.buckets, reduced, strict=True):
                unpacked.update(unpack_bucket(bucket, flat, bucket.dtype))
            grads = self.treedef.unflatten([unpacked[i] for i in range(len(unpacked))])
        updates, new_opt = self.optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        skipped = jnp.zeros((), jnp.bool_)
        if cfg.skip_nonfinite:
            skipped = ~jnp.isfinite(norm)  # a NaN/Inf anywhere makes the global norm non-finite
            new_params, new_opt = keep_if(skipped, (new_params, new_opt), (params, opt_state))
        return new_params, new_opt, {"loss": loss, "grad_norm": norm, "skipped": skipped}


class _BucketSchedule(Schedule):
    """The communication of one DDP step, on one token chain.

    Gradients: bucket b's reduction starts as soon as its gradients exist; the
    oldest pending one is waited when the next starts, and the following
    equation is tied to that wait, so at most two reductions are in flight and
    each overlaps the backward compute between two buckets.
    Parameters (zero1): the gather of the next bucket in forward order starts
    when the current one is waited, just before its first use.
    """

    def __init__(self, run: DDPRun, tok, shards, gather_order, n_stored: int):
        self.cfg, self.layout = run.cfg, run.layout
        self.first_grad = 1 + n_stored  # the index of the first gradient among the step's outputs
        self.tok = tok
        self.shards = shards
        self.accumulated = None
        self.pending: list[tuple[int, Any]] = []
        self.reduced: dict[int, jax.Array] = {}
        self.tie_next = False
        self.gathers: dict[int, Any] = {}
        self.gather_order = gather_order  # buckets in the order the forward first reads them
        if shards is not None:
            self._start_gather(0)

    def _start_gather(self, position: int):
        if position < len(self.gather_order):
            b = self.gather_order[position]
            self.gathers[b], self.tok = comm.all_gather_start(
                self.shards[b], self.cfg.axis, self.tok, tiled=True, backend=self.cfg.backend
            )

    def _wait_gather(self, b: int) -> dict[int, jax.Array]:
        flat, self.tok = comm.wait(self.gathers.pop(b), self.tok)
        self._start_gather(self.gather_order.index(b) + 1)
        return unpack_bucket(self.layout.buckets[b], flat)

    def gather_all(self) -> list:
        leaves = {}
        for b in list(self.gather_order):
            leaves.update(self._wait_gather(b))
        return [leaves[i] for i in range(len(leaves))]

    def fetch(self, b, ties):
        ties, self.tok = comm.tie(ties, self.tok)  # the gather of the next bucket waits for this compute
        return self._wait_gather(b), ties

    def ready(self, b, values):
        bucket = self.layout.buckets[b]
        grads = {i - self.first_grad: g for i, g in values.items()}
        if self.accumulated is not None:  # the mean over micro-batches, like one big batch
            a = self.cfg.accumulation_steps
            grads = {i: (g + self.accumulated[i]) / np.asarray(a, g.dtype) for i, g in grads.items()}
        dtype = self.cfg.reduce_dtype or bucket.dtype
        flat = pack_bucket(bucket, grads, dtype)
        op = "mean"
        if not self.cfg.average_in_collective:
            flat, op = flat * np.asarray(1 / self.cfg.dp, dtype), "sum"
        start = comm.reduce_scatter_start if self.cfg.zero1 else comm.all_reduce_start
        handle, self.tok = start(flat, self.cfg.axis, self.tok, op=op, backend=self.cfg.backend)
        if self.pending:
            self._finish_oldest()
            self.tie_next = True
        self.pending.append((b, handle))

    def _finish_oldest(self):
        b, handle = self.pending.pop(0)
        self.reduced[b], self.tok = comm.wait(handle, self.tok)

    def before(self, inputs):
        if self.tie_next and inputs:
            self.tie_next = False
            inputs, self.tok = comm.tie(inputs, self.tok)
        return inputs

    def drain(self) -> list:
        """Finish every reduction (and any unread gather); the reduced buckets in bucket order."""
        while self.pending:
            self._finish_oldest()
        for b in list(self.gathers):
            self._wait_gather(b)
        return [self.reduced[b] for b in range(len(self.layout))]
