"""The unit engine: data parallelism (replicated, ZeRO-1 or ZeRO-3 storage) x tensor parallelism
through a plan, over an unmodified Flax NNX model split into units.

A model splits into units (`Units`): the part before the repeated blocks
(`embed`), each block, and the part after (`head_loss`). Every parameter is
stored as one `jax.Array` of the model's own shape (the optimizer sees the
model's parameter tree, so any optax transformation is exact), sharded:

* over `tp` as the `TPPlan` places it (column, row, vocab or replicated);
* over the data axes by the storage mode: replicated (plain DP), ZeRO-1
  (sharded over `dp`, gathered once per step and kept for backward) or
  ZeRO-3 (sharded over `fsdp`, gathered before forward and again before
  backward, which recomputes each block's forward or, with `remat=False`,
  keeps its activations and rebuilds only the residuals of its weights alone:
  `jaxdist.engine.residuals`). HSDP is ZeRO-3 over `fsdp` with replicas over `dp`.

A step gathers each unit's pieces over the storage axis one unit ahead of its
use, runs the unit's own code (the model's modules, with the plan's parallel
layers bound in place of the matched ones), and reduces each unit's gradients
while the previous unit runs backward. Both loops are
`jaxdist.engine.prefetch.pipelined_loop` (unrolled, since each block may have its
own structure), so a unit's weights exist only as the value returned by the
wait of this step's gather (no read before publication: docs/design.md), and the carry bounds
the gathered units (no third buffer). The optimizer then updates the sharded parameter tree
outside the per-device program, where global reductions (clipping) are exact;
with `update_in_backward` it updates each unit inside it instead, as soon as
the unit's gradients are reduced (per-leaf optimizers only). FSDP
(`jaxdist.engine.fsdp`) is this engine with ZeRO-3 storage and no tp.
"""

from __future__ import annotations

import contextlib
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

from jaxdist import comm, cp
from jaxdist.core.canonical import canonical_avals, check_canonical, mirror_map, with_shardings
from jaxdist.core.compat import model_sharding_dropped
from jaxdist.core.model_state import ModelState, keep_if, split_params, training_copy
from jaxdist.core.per_leaf import check_per_leaf, owners
from jaxdist.core.step import (
    PlacedStep,
    TrainState,
    local_batch_avals,
    on_auto_axes,
    on_own_mesh,
    optimizer_step,
    own_mesh,
)
from jaxdist.engine.prefetch import AsyncOp, check_buffers, kept, pipelined_loop
from jaxdist.engine.residuals import rebuild, weight_only, weight_only_values
from jaxdist.tp import layers as tp_math
from jaxdist.tp.grads import tp_summed
from jaxdist.tp.plan import Binding, CallLog, ResolvedPlan, TPPlan, bind, from_storage, to_storage


@dataclasses.dataclass(frozen=True)
class Units:
    """How a model splits into units: `embed(model, batch) -> x`, then every block of
    `getattr(model, blocks)` as `x = block_call(block, x, batch)`, then
    `head_loss(model, x, batch) -> loss`.

    Attributes:
      embed: the part before the blocks.
      head_loss: the part after the blocks and the loss: a scalar mean, or with
        `sum_and_count` a pair `(sum, count)`; with `has_aux` a pair `(loss, aux)`.
      blocks: the attribute holding the blocks: a sequence (`nnx.List`) or, with
        `stacked`, one module whose parameters have a leading layer axis
        (made with `nnx.vmap`, run with `nnx.scan`); unit i is layer i.
      block_call: how one block runs (default `block(x)`): side inputs from the
        batch (positions, masks, segment ids), and the activations picked out of
        a tuple output, e.g. `lambda blk, x, b: blk(x, b["pos"], b["mask"])[1]`.
        The batch is this data rank's rows; under sequence parallelism `x` is this
        tp rank's chunk of the tokens (`sequence_dim`) while the batch's arrays stay whole.
      stacked: `blocks` is a stacked module (see above).
      has_aux: `head_loss` returns `(loss, aux)`; aux (a pytree of arrays, not
        differentiated) comes back in `metrics["aux"]`: a leaf whose leading
        dimension is the local batch size holds per-example values and comes back
        for the whole global batch, every other leaf is averaged over the data ranks.
      sum_and_count: `head_loss`'s loss is `(sum, count)` (e.g. of real tokens under
        a padding mask); the loss is the sum over all data ranks divided by the
        count over all data ranks, and so are the gradients (the single-device
        token mean, where a mean of per-rank means is not when ranks hold
        different counts).
    """

    embed: Callable[[nnx.Module, Any], jax.Array]
    head_loss: Callable[[nnx.Module, jax.Array, Any], Any]
    blocks: str = "blocks"
    block_call: Callable[[nnx.Module, jax.Array, Any], jax.Array] | None = None
    stacked: bool = False
    has_aux: bool = False
    sum_and_count: bool = False


@dataclasses.dataclass(frozen=True)
class Parallel:
    """Options of DP x FSDP x TP x CP training over the mesh axes that exist.

    Attributes:
      mesh: the device mesh; any of the axes `dp_axis`, `fsdp_axis`, `tp_axis`.
      plan: how layers split over `tp_axis` (needed when that axis has size > 1).
      zero1: without an `fsdp` axis, shard parameters and optimizer state over
        `dp` (gathered once per step and kept for backward); False replicates them.
      reshard_after_forward: with an `fsdp` axis, drop gathered units after the
        forward and gather them again for backward (ZeRO-3); False keeps them.
      sequence_parallel: between the tp layers, activations are split over `tp`
        along a token dimension: `sequence_dim`.
      sequence_dim: the activations' dimension sequence parallelism splits; None
        (default) takes the leading (batch) dimension when tp divides it, else
        dimension 1 (the sequence). The leading dimension is the faster on GPU
        (its gathers and reduce-scatters need no transposes); pass 1 where the
        block's code slices side inputs to its sequence chunk.
      remat: how backward gets each block's activations. None (default): kept from the forward
        when the weights are kept (replicated, ZeRO-1, `reshard_after_forward=False`), recomputed
        on the re-gathered weights under ZeRO-3. True: always recomputed (`jax.checkpoint`
        around the gathered weights: no second gather). False: always kept; under ZeRO-3 the
        forward keeps only the residuals that depend on the activations and backward rebuilds
        those of the weights alone (casts, transposes) from the re-gathered weights, as PyTorch
        FSDP does: no second forward, activation memory as plain autodiff.
      buffers: how many gathered units may exist at once (>= 2).
      prefetch: how many units ahead gathers start; needs `prefetch + 1 <= buffers`
        (the loop's carry then holds `prefetch` in-flight units, so a third buffer
        cannot be written with the default 2).
      compute_dtype: dtype parameters are gathered and computed in (e.g. bfloat16): each
        piece is cast before its gather, so the collective moves this dtype, while the
        stored (master) parameters and the optimizer keep the model's dtype. None: the
        model's dtype.
      reduce_dtype: dtype gradients are reduced in (default: their own dtype, the compute
        dtype); the optimizer receives them in the parameters' dtype.
      update_in_backward: update each unit as soon as its gradients are reduced, inside the
        step, so the gradients of all units never exist at once. The optimizer then runs
        unit by unit on the unit's parameters and state, which is exact only for per-leaf
        transformations (adam, adamw, sgd, lion, masks, multi_transform by path): one that
        combines parameters (clip_by_global_norm, apply_if_finite) raises at `prepare`.
        Excludes `max_grad_norm` and `skip_nonfinite` (both need every gradient before any
        update); `metrics["grad_norm"]` is NaN.
      max_grad_norm: clip by the global gradient norm, or None.
      skip_nonfinite: skip the update (and report it) when the gradient norm is NaN/Inf
        (default: on, unless `update_in_backward`).
      record_weights: report, per block, the sum of the weights its forward and its backward
        computed with (`metrics["weights_used"]`, `metrics["weights_used_backward"]`; a test probe
        that costs reductions per step).
      backend: the `jaxdist.comm` backend.
      cp_axis: the context-parallel axis (docs/guides/context-parallel.md): each data rank's sequences are
        cut into 2 cp chunks along dimension 1, rank r holding chunks r and 2 cp - 1 - r; every batch array
        with the sequence along dimension 1 is cut alike, `batch["positions"]` (the tokens' global positions)
        is added when absent, and the model's `jax.nn.dot_product_attention` calls see the keys and values of
        every cp rank (`jaxdist.cp`). Gradients average over it like a data axis.
      cp_whole: batch keys every cp rank sees whole (not cut): arrays the model builds its attention mask
        from over the whole sequence, such as the document ids of packed sequences.
    """

    mesh: jax.sharding.Mesh
    plan: TPPlan | None = None
    dp_axis: str = "dp"
    fsdp_axis: str = "fsdp"
    tp_axis: str = "tp"
    zero1: bool = True
    reshard_after_forward: bool = True
    sequence_parallel: bool = False
    sequence_dim: int | None = None
    remat: bool | None = None
    buffers: int = 2
    prefetch: int = 1
    compute_dtype: Any = None
    reduce_dtype: Any = None
    update_in_backward: bool = False
    max_grad_norm: float | None = None
    skip_nonfinite: bool | None = None
    record_weights: bool = False
    backend: str | None = None
    cp_axis: str = "cp"
    cp_whole: tuple[str, ...] = ("segment_ids",)

    def __post_init__(self):
        names = self.mesh.axis_names
        roles = self._axis_roles()
        if len(set(roles.values())) < len(roles):
            named = ", ".join(f"{role}={axis!r}" for role, axis in roles.items())
            raise ValueError(
                f"{type(self).__name__}: {named} name one axis twice; each role needs its own mesh axis (leave a "
                "role's default name where the mesh has no such axis)"
            )
        unknown = [a for a in names if a not in roles.values()]
        if unknown:
            raise ValueError(
                f"Parallel: mesh axes {unknown} are none of dp_axis={self.dp_axis!r}, fsdp_axis={self.fsdp_axis!r}, "
                f"tp_axis={self.tp_axis!r}, cp_axis={self.cp_axis!r}; name the mesh axes after them or pass the "
                "names (a pipeline axis: jaxdist.pipeline.Pipelined)"
            )
        if self.tp > 1 and self.plan is None:
            raise ValueError(f"Parallel: the {self.tp_axis!r} axis has size {self.tp}; pass plan=TPPlan(...)")
        check_buffers("Parallel", self.buffers, self.prefetch)
        if self.remat not in (None, True, False):
            raise ValueError(f"Parallel: remat must be None (auto), True or False, got {self.remat!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("Parallel: sequence_parallel needs a tp axis of size > 1")
        if self.sequence_dim is not None and not self.sequence_parallel:
            raise ValueError("Parallel: sequence_dim only applies with sequence_parallel=True; drop it or turn that on")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            # the clip scales gradients by max_grad_norm / norm: 0 would freeze training and a negative
            # value reverse it, silently
            raise ValueError(f"Parallel: max_grad_norm must be positive or None, got {self.max_grad_norm!r}")
        if self.update_in_backward and self.max_grad_norm is not None:
            raise ValueError(
                "Parallel: update_in_backward updates each unit before the global gradient norm exists, so it cannot "
                "clip by it; drop max_grad_norm or set update_in_backward=False"
            )
        if self.update_in_backward and self.skip_nonfinite:
            raise ValueError(
                "Parallel: update_in_backward updates units before every gradient is known, so it cannot skip a step "
                "with a NaN/Inf gradient; pass skip_nonfinite=False or set update_in_backward=False"
            )

    @property
    def skips_nonfinite(self) -> bool:
        return self.skip_nonfinite if self.skip_nonfinite is not None else not self.update_in_backward

    def _axis_roles(self) -> dict[str, str]:
        """The mesh axis of each role these options place work on (a subclass adding an axis extends it)."""
        return {"dp_axis": self.dp_axis, "fsdp_axis": self.fsdp_axis, "tp_axis": self.tp_axis, "cp_axis": self.cp_axis}

    def _size(self, axis: str) -> int:
        return self.mesh.shape[axis] if axis in self.mesh.axis_names else 1

    @property
    def tp(self) -> int:
        return self._size(self.tp_axis)

    @property
    def cp(self) -> int:
        return self._size(self.cp_axis)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The data axes of size > 1 (an axis of size 1 would only add no-op collectives and the
        packing of their buffers to every step); cp is one: its ranks hold other tokens of the batch."""
        return tuple(a for a in (self.dp_axis, self.fsdp_axis, self.cp_axis) if self._size(a) > 1)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The data axes the batch's rows split over (cp splits the sequence instead)."""
        return tuple(a for a in self.data_axes if a != self.cp_axis)

    @property
    def storage_axis(self) -> str | None:
        """The data axis parameters are sharded over: fsdp (ZeRO-3), else dp with zero1, else none."""
        if self.fsdp_axis in self.data_axes:
            return self.fsdp_axis
        if self.zero1 and self.dp_axis in self.data_axes:
            return self.dp_axis
        return None

    @property
    def regather(self) -> bool:
        return self.storage_axis == self.fsdp_axis and self.reshard_after_forward

    @property
    def backward_residuals(self) -> str:
        """Where backward gets a block's residuals: "kept" (the forward's vjp, weights kept anyway),
        "recompute" (the forward replayed on the re-gathered weights) or "rebuild" (ZeRO-3 keeping
        activations: the forward's activation residuals, the weights' own rebuilt from the re-gathered
        weights)."""
        if not self.regather:
            return "kept"
        return "rebuild" if self.remat is False else "recompute"

    def prepare(self, model: nnx.Module, optimizer: optax.GradientTransformation, units: Units, batch):
        """Shard `model`'s parameters and build the train step.

        Args:
          model: a Flax NNX model; `units` says how it splits.
          optimizer: any optax transformation; it sees the model's parameter tree.
          units: the model's embed / blocks / head split.
          batch: an example global batch (a pytree); its leading dimension is split over the data axes.
        """
        return ParallelRun(self, model, optimizer, units, batch)


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One parameter: its path, full shape, how it splits over tp and over the storage axis."""

    path: tuple
    shape: tuple
    dtype: Any
    tp_dim: int | None
    groups: int
    local: tuple  # this rank's tp piece
    store_dim: int | None  # dimension of the tp piece sharded over the storage axis

    @property
    def name(self) -> str:
        return "/".join(map(str, self.path))


class ParallelRun:
    """A prepared run: `state`, `step(state, batch) -> (state, metrics)`, `params(state)`, `model(state)`."""

    def __init__(self, cfg: Parallel, model: nnx.Module, optimizer, units: Units, batch):
        self.cfg, self.optimizer, self.units = cfg, optimizer, units
        self._weight_only_cache: dict = {}
        self.mesh = own_mesh(cfg.mesh)
        self._prepare(model, batch)

    @on_own_mesh  # inside a user's jax.set_mesh too
    def _prepare(self, model: nnx.Module, batch) -> None:
        cfg, optimizer, units = self.cfg, self.optimizer, self.units
        model = training_copy(model)  # the step runs train mode; the caller's model is untouched
        nnx.update(model, on_auto_axes(nnx.state(model)))  # a model built inside a user's jax.set_mesh
        self._split_blocks(model, units)
        self.graphdef, params, rest = split_params(model, type(cfg).__name__)
        self._split_model_state(rest, units)
        self.template = params
        pure = nnx.to_pure_dict(params)
        self.placements = self._resolve_plan(model, pure, rest, batch) if cfg.plan is not None and cfg.tp > 1 else None
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(pure)
        paths = [tuple(getattr(k, "key", getattr(k, "idx", k)) for k in kp) for kp, _ in flat]
        n_store = cfg._size(cfg.storage_axis) if cfg.storage_axis else 0
        self.leaves = [self._leaf(path, x, n_store) for path, (_, x) in zip(paths, flat, strict=True)]
        if units.stacked:
            stacked = [k for k, leaf in enumerate(self.leaves) if leaf.path[0] == units.blocks]
            self.block_leaves = [stacked] * self.n_blocks
        else:
            self.block_leaves = [
                [k for k, leaf in enumerate(self.leaves) if leaf.path[:2] == (units.blocks, i)]
                for i in range(self.n_blocks)
            ]
        if self.n_blocks == 0:
            raise ValueError(f"Parallel: the model's {units.blocks!r} holds no blocks; units need at least one")
        for i in range(self.n_blocks if not units.stacked else 0):
            if self.block_trees[i].num_leaves != len(self.block_leaves[i]):
                raise ValueError(
                    f"Parallel: block {i} shares parameters with another part of the model; every block must own "
                    "its parameters (a tied weight belongs to the embed and head units)"
                )
        outer = [k for k, leaf in enumerate(self.leaves) if leaf.path[0] != units.blocks]
        n_data = int(np.prod([cfg._size(a) for a in cfg.data_axes]))
        self.n_data = n_data
        self.local_batch = self._check_batch(batch)
        start = self.initial_model_state["outer"]
        embed = lambda ws, b: self._outer_apply(ws, start, lambda m: units.embed(m, b), bound=False)[0]
        x_aval = jax.eval_shape(embed, self._avals(outer, whole=True), self.local_batch)
        if cfg.cp > 1:  # context parallelism: from here on, one cp rank's chunks of the sequence
            x_aval = self._cp_prepare(x_aval, lambda b: jax.eval_shape(embed, self._avals(outer, whole=True), b), rest)
        self.sequence_dim = _sequence_dim(cfg, x_aval.shape)
        zeros_x = lambda: jnp.zeros(x_aval.shape, x_aval.dtype)
        head = lambda ws, b: self._outer_apply(ws, start, lambda m: units.head_loss(m, zeros_x(), b), bound=False)[0]
        self.aux_specs = self._aux_specs(jax.eval_shape(head, self._avals(outer, whole=True), self.local_batch))
        everything = range(len(self.leaves))
        read_by_embed = self._reads(embed, everything)
        read_by_head = self._reads(head, everything)
        self._check_outer_reads(read_by_embed - set(outer), "embed")
        self._check_outer_reads(read_by_head - set(outer), "head_loss")
        self.embed_leaves = [k for k in outer if k in read_by_embed]
        self.head_leaves = [k for k in outer if k in read_by_head or k not in read_by_embed]
        self.tied = [k for k in self.embed_leaves if k in self.head_leaves]
        # under cp the blocks' attention traced on one rank's shapes: the whole context's keys (jaxdist.cp)
        with cp.probe_attention(cfg.cp, self.cp_length) if cfg.cp > 1 else contextlib.nullcontext():
            self.tp_sums = self._decide_tp_sums(x_aval) if cfg.tp > 1 else {}
        if cfg.update_in_backward:
            check_per_leaf(optimizer, pure, "Parallel")
        self.state = self._init_state(pure)
        self.opt_owners = owners(self.state.opt_state, self.state.params)
        self.step = PlacedStep(self._step, self._sharding(self._batch_spec()), check=self._check_batch)

    def _check_batch(self, batch):
        """One data rank's avals of a global `batch` (prepare's example or a step's); a batch that does
        not split over the data axes raises, naming the fix."""
        cfg = self.cfg
        rows = int(np.prod([cfg._size(a) for a in cfg.batch_axes]))
        fix = f"the {rows} devices of the data axes {cfg.batch_axes}; change the batch size"
        return local_batch_avals(batch, rows, type(cfg).__name__, fix)

    def _cp_prepare(self, x_whole, embed_shape, rest):
        """Context parallelism at prepare: the sequence length, one cp rank's batch avals (`local_batch`
        from here on), the model checked to run correctly on them (`jaxdist.cp.check_model`); returns the
        activations' aval on one cp rank."""
        cfg, units, who = self.cfg, self.units, type(self.cfg).__name__
        self.cp_length = cp.sequence_length(self.local_batch, x_whole.shape, who)
        self.local_batch = cp.local_batch_avals(self.local_batch, cfg.cp, self.cp_length, cfg.cp_whole, who)
        x_aval = embed_shape(self.local_batch)
        if x_aval.shape[1] != 2 * cp.chunk_len(cfg.cp, self.cp_length):
            raise ValueError(
                f"{who}: under cp the embed made activations {x_aval.shape} of one rank's batch; cp cuts every batch "
                f"array whose dimension 1 has the sequence length {self.cp_length}: give inputs and targets that "
                "length (for jaxdist's GPT: jaxdist.models.gpt.next_token_batch)"
            )

        @model_sharding_dropped()
        def run_model(params, batch):  # the model as on one device, as `_resolve_plan` traces it
            model = nnx.merge(self.graphdef, params, rest)
            x = units.embed(model, batch)
            for i in range(1 if units.stacked else self.n_blocks):
                block = self._first_layer if units.stacked else getattr(model, units.blocks)[i]
                x = self._block_call(i, block, x, batch, units.block_call)
            units.head_loss(model, x, batch)
            return jnp.zeros(())

        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), nnx.to_pure_dict(self.template))
        cp.check_model(run_model, shapes, self.local_batch, cfg.cp, self.cp_length, who)
        return x_aval

    def _check_outer_reads(self, block_reads: set[int], unit: str) -> None:
        """The embed and head units run on the outer parameters only (a block's parameters are gathered for
        its own unit): one that reads a block's parameters would compute with zeros in their place."""
        if block_reads:
            names = ", ".join(self.leaves[k].name for k in sorted(block_reads)[:3])
            names += " ..." if len(block_reads) > 3 else ""
            raise ValueError(
                f"Parallel: Units.{unit} reads parameters of the blocks ({names}); "
                "the embed and head units see only the parameters outside the blocks. Run that module as a block "
                "(or give the embed / head a module of its own), or use DDP, which has no units"
            )

    # -- blocks and layout -----------------------------------------------------------

    def _split_blocks(self, model, units: Units) -> None:
        """Each block's graphdef (its own code and static attributes), non-parameter state and
        parameter tree structure, and its kind (`definition_kinds`); a stacked module's layers share
        its single-layer graphdef."""
        blocks = getattr(model, units.blocks, None)
        if units.stacked:
            if not isinstance(blocks, nnx.Module) or hasattr(blocks, "__len__"):
                raise ValueError(
                    f"Parallel: Units(stacked=True) needs one module with stacked layers at attribute "
                    f"{units.blocks!r}, got {type(blocks).__name__}; pass stacked=False for a list of blocks"
                )
            g, p, r = nnx.split(blocks, nnx.Param, ...)
            leads = {x.shape[0] if x.ndim else None for x in jax.tree.leaves(p)}
            if len(leads) != 1 or None in leads:
                raise ValueError(
                    f"Parallel: the stacked layers at {units.blocks!r} must hold every parameter with one "
                    f"leading layer axis; found leading sizes {sorted(leads, key=str)}"
                )
            self.n_blocks = leads.pop()
            layer = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
            self.block_defs = [g] * self.n_blocks
            self.block_kinds = [0] * self.n_blocks
            self.block_rests = [layer(r, i) for i in range(self.n_blocks)]
            self.block_trees = [jax.tree.structure(nnx.to_pure_dict(p))] * self.n_blocks
            self._first_layer = nnx.merge(g, layer(nnx.to_pure_dict(p), 0), self.block_rests[0])
            return
        if blocks is None or not hasattr(blocks, "__len__"):
            hint = (
                "; for layers stacked with nnx.vmap pass Units(stacked=True)" if isinstance(blocks, nnx.Module) else ""
            )
            raise ValueError(f"Parallel: the model has no list of blocks at attribute {units.blocks!r}{hint}")
        self.n_blocks = len(blocks)
        self.block_defs, self.block_rests, self.block_trees = [], [], []
        for i in range(self.n_blocks):
            g, p, r = nnx.split(blocks[i], nnx.Param, ...)
            self.block_defs.append(g)
            self.block_rests.append(r)
            self.block_trees.append(jax.tree.structure(nnx.to_pure_dict(p)))
        self.block_kinds = definition_kinds(self.block_defs)

    def _split_model_state(self, rest, units: Units) -> None:
        """The non-parameter variables (RNG streams, batch statistics, constants): the outer model's,
        and each block's own, as `jaxdist.core.model_state.ModelState`s stored in the train state."""
        in_model = rest.get(units.blocks, nnx.State({}))
        outer_rest = nnx.State({k: v for k, v in rest.items() if k != units.blocks})
        self.outer_state = ModelState(outer_rest)
        self.blocks_fixed = {units.blocks: in_model} if units.blocks in rest else {}  # completes the outer model
        if units.stacked:  # layers keep their slices of the stacked module's constants
            kinds = {type(v).__name__ for _, v in in_model.flat_state()}
            mutable = sorted(k for k in kinds if k in ("RngCount", "RngKey", "BatchStat"))
            if mutable:
                raise ValueError(
                    f"Parallel: stacked layers holding {mutable} variables (Dropout / BatchNorm state) are not "
                    "supported yet; pass the blocks as a list (Units(stacked=False))"
                )
            self.block_states = None
            blocks = {}
        else:
            placed = nnx.to_pure_dict(in_model)
            for i, own in enumerate(self.block_rests):
                if jax.tree.structure(nnx.to_pure_dict(own)) != jax.tree.structure(placed.get(i, {})):
                    raise ValueError(
                        f"Parallel: block {i} shares non-parameter variables with another part of the model; every "
                        "block must own its variables (give each block its own, e.g. its own dropout RNG stream)"
                    )
            self.block_states = [ModelState(r) for r in self.block_rests]
            blocks = {i: ms.store(r) for i, (ms, r) in enumerate(zip(self.block_states, self.block_rests, strict=True))}
        self.initial_model_state = {"outer": self.outer_state.store(outer_rest), "blocks": blocks}

    def _rest(self, model_state) -> nnx.State:
        """The model's non-parameter variables from the train state's `model_state`."""
        rest = dict(self.outer_state.load(model_state["outer"]))
        if self.block_states is not None and self.blocks_fixed:
            loaded = {i: ms.load(model_state["blocks"][i]) for i, ms in enumerate(self.block_states)}
            rest[self.units.blocks] = nnx.State(loaded)
        elif self.blocks_fixed:
            rest.update(self.blocks_fixed)
        return nnx.State(rest)

    def _plan_modules(self, model):
        """The model's modules as the plan sees them: a stacked module as one layer (its own
        parameter shapes without the layer axis) at the stacked module's path."""
        if not self.units.stacked:
            return list(nnx.iter_graph(model))
        name = self.units.blocks
        outer = [(path, m) for path, m in nnx.iter_graph(model) if not path or path[0] != name]
        return outer + [((name, *path), m) for path, m in nnx.iter_graph(self._first_layer)]

    @model_sharding_dropped()  # the units' code traced as on one device: the model's own sharding calls are no-ops
    def _resolve_plan(self, model, pure, rest, batch) -> ResolvedPlan:
        """The plan on the model (`TPPlan.resolve`): from one trace of the units on the model as on one
        device (shapes only), the placed layers' equations and the order each unit calls them in."""
        units, log = self.units, CallLog(self.cfg.plan)
        shapes = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)

        def trace(params, batch, rest, layer_rest):  # variables enter as inputs: RNG counts mutate in the trace
            model = log.watch(nnx.merge(self.graphdef, params, rest))
            with log.unit("the embed"):
                x = units.embed(model, batch)
            for i in range(1 if units.stacked else self.n_blocks):
                if units.stacked:  # one layer of the stacked module: all run its code
                    layer = jax.tree.map(lambda a: a[0], params[units.blocks])
                    block = log.watch(nnx.merge(self.block_defs[0], layer, layer_rest), (units.blocks,))
                else:
                    block = getattr(model, units.blocks)[i]
                with log.unit(f"block {i}"):
                    self._block_call(i, block, x, batch, units.block_call)
            with log.unit("the head"):
                units.head_loss(model, x, batch)
            return jnp.zeros(())

        layer_rest = self.block_rests[0] if units.stacked else None
        jax.eval_shape(trace, shapes(pure), shapes(batch), shapes(rest), shapes(layer_rest))
        return self.cfg.plan.resolve(self._plan_modules(model), self.cfg.tp, log)

    def _block_prefix(self, i: int) -> tuple:
        return (self.units.blocks,) if self.units.stacked else (self.units.blocks, i)

    def _leaf(self, path, x, n_store) -> _Leaf:
        cfg = self.cfg
        # a stacked leaf's layer axis is never split: tp and storage dims count past it
        skip = 1 if self.units.stacked and path[0] == self.units.blocks else 0
        dim, groups = (None, 1)
        if self.placements is not None:
            dim, groups = self.placements.param_split(path, x.ndim - skip)
            dim = None if dim is None else dim + skip
        local = tuple(s // cfg.tp if d == dim else s for d, s in enumerate(x.shape))
        store = None
        if n_store:  # the largest dimension of the tp piece that divides evenly
            fits = [d for d in range(skip, len(local)) if local[d] % n_store == 0]
            store = max(fits, key=lambda d: (local[d], -d)) if fits else None
        return _Leaf(path, tuple(x.shape), x.dtype, dim, groups, local, store)

    def _store_dim(self, k: int, piece) -> int | None:
        """The storage dim of leaf `k` in `piece` (one layer of a stacked leaf has one axis fewer)."""
        leaf = self.leaves[k]
        return None if leaf.store_dim is None else leaf.store_dim - (len(leaf.shape) - piece.ndim)

    def _aux_specs(self, out_aval):
        """Check `head_loss`'s output against the units' flags; the out spec of each aux leaf."""
        units = self.units
        loss = out_aval
        if units.has_aux:
            if not (isinstance(out_aval, tuple) and len(out_aval) == 2):
                raise ValueError("Parallel: Units(has_aux=True) needs head_loss to return (loss, aux)")
            loss, aux = out_aval
        if units.sum_and_count:
            ok = isinstance(loss, tuple) and len(loss) == 2 and all(x.shape == () for x in loss)
            if not ok:
                raise ValueError(
                    "Parallel: Units(sum_and_count=True) needs head_loss's loss to be (sum, count) scalars"
                )
        elif not (hasattr(loss, "shape") and loss.shape == ()):
            flag = "; pass Units(has_aux=True) or Units(sum_and_count=True)" if isinstance(loss, tuple) else ""
            raise ValueError(f"Parallel: head_loss must return a scalar loss{flag}, got {loss}")
        if not units.has_aux:
            return None
        rows = jax.tree.leaves(self.local_batch)[0].shape[0]
        batch_axes = self.cfg.batch_axes
        per_example = P(_axes(batch_axes)) if batch_axes else P()
        specs = jax.tree.map(lambda a: per_example if a.ndim and a.shape[0] == rows else P(), aux)
        if self.cfg.cp > 1 and any(s != P() for s in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))):
            raise ValueError(
                "Parallel: under cp each rank's per-example aux values cover only its tokens; return scalar aux "
                "values (averaged over the ranks) or leave cp out"
            )
        return specs

    def _spec(self, leaf: _Leaf) -> P:
        cfg = self.cfg
        dims: list = [None] * len(leaf.shape)
        if leaf.tp_dim is not None:
            dims[leaf.tp_dim] = cfg.tp_axis
        if leaf.store_dim is not None:
            axis = cfg.storage_axis
            dims[leaf.store_dim] = axis if dims[leaf.store_dim] is None else (cfg.tp_axis, axis)
        return P(*dims)

    def _param_specs(self):
        return self.treedef.unflatten([self._spec(leaf) for leaf in self.leaves])

    def _sharding(self, spec):
        return NamedSharding(self.mesh, spec)

    def _avals(self, indices, whole: bool = False):
        shape = (lambda leaf: leaf.shape) if whole else (lambda leaf: leaf.local)
        return {k: jax.ShapeDtypeStruct(shape(self.leaves[k]), self.leaves[k].dtype) for k in indices}

    # -- state -------------------------------------------------------------------

    def _init_state(self, pure) -> TrainState:
        tp = self.cfg.tp
        shardings = jax.tree.map(self._sharding, self._param_specs(), is_leaf=lambda s: isinstance(s, P))

        def store(pure):
            xs = jax.tree.leaves(pure)
            out = [to_storage(x, leaf.tp_dim, leaf.groups, tp) for x, leaf in zip(xs, self.leaves, strict=True)]
            return self.treedef.unflatten(out)

        params = jax.jit(store, out_shardings=shardings)(pure)
        replicated = self._sharding(P())
        opt_shapes = jax.eval_shape(self.optimizer.init, params)
        opt_shardings = mirror_map(opt_shapes, params, lambda _, p: p.sharding, lambda _: replicated)
        opt_state = jax.jit(self.optimizer.init, out_shardings=opt_shardings)(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), self._sharding(P()))
        model_state = jax.device_put(self.initial_model_state, self._sharding(P()))
        self.state_shardings = TrainState(
            shardings, jax.tree.map(lambda x: x.sharding, opt_state), step.sharding, self._sharding(P())
        )
        return TrainState(params, opt_state, step, model_state)

    @on_own_mesh
    def params(self, state: TrainState):
        """The full parameters of `state` as the single-device model holds them (an `nnx.State`), replicated."""
        return self._as_params(self._replicated(state.params, None)[0])

    @on_own_mesh
    def model(self, state: TrainState) -> nnx.Module:
        """An NNX model holding the parameters of `state`."""
        full, model_state = self._replicated(state.params, state.model_state)
        return nnx.merge(self.graphdef, self._as_params(full), self._rest(model_state))

    def _as_params(self, full: list) -> nnx.State:
        out = jax.tree.map(lambda x: x, self.template)
        nnx.replace_by_pure_dict(out, self.treedef.unflatten(full))
        return out

    @functools.cached_property
    def _replicated(self):
        # one program that every process runs: a `device_put` per leaf starts a small cross-process program
        # each, and independent programs may run concurrently (CPU, gloo), their collectives then met in
        # another order by each process: a hang
        def full(params, model_state):
            xs = jax.tree.leaves(params)
            tp = self.cfg.tp
            return [from_storage(x, leaf.tp_dim, leaf.groups, tp) for x, leaf in zip(xs, self.leaves, strict=True)], (
                model_state
            )

        return jax.jit(full, out_shardings=self._sharding(P()))

    # -- the canonical state (jaxdist.core.canonical) ---------------------------------------
    # The parameters are already the model's tree, sharded like the canonical form; only grouped
    # column layers are stored in another order along their tp dimension (`to_storage`).

    @on_own_mesh
    def canonical_shardings(self) -> TrainState:
        """Where the canonical state lives: parameters and the optimizer state mirroring them sharded as
        stored (over tp and the storage axis), except grouped columns (see `_canonical_spec`); everything
        else replicated."""
        replicated = self._sharding(P())
        params = self.treedef.unflatten(
            [
                jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=self._sharding(self._canonical_spec(leaf)))
                for leaf in self.leaves
            ]
        )
        opt = mirror_map(
            jax.eval_shape(self.optimizer.init, params), params, lambda _, p: p.sharding, lambda _: replicated
        )
        model_state = jax.tree.map(lambda _: replicated, self._model_avals())
        return TrainState(jax.tree.map(lambda p: p.sharding, params), opt, replicated, model_state)

    def _canonical_spec(self, leaf: _Leaf) -> P:
        """The storage spec, but a grouped column (fused q/k/v), stored in another order along its tp
        dimension, is split along another dimension instead: the reorder is then local to each device
        and the resharding an all-to-all (sharded along the tp dimension it would need whole copies)."""
        spec = self._spec(leaf)
        if leaf.groups == 1 or leaf.tp_dim is None:
            return spec
        axes = [a for part in spec if part is not None for a in (part if isinstance(part, tuple) else (part,))]
        n = int(np.prod([self.cfg._size(a) for a in axes]))
        others = [d for d, size in enumerate(leaf.shape) if d != leaf.tp_dim and size % n == 0]
        if not others:
            return spec  # e.g. a fused bias: one dimension, small
        dim = max(others, key=lambda d: (leaf.shape[d], -d))
        return P(*[(tuple(axes) if len(axes) > 1 else axes[0]) if d == dim else None for d in range(len(leaf.shape))])

    def _model_avals(self):
        return jax.eval_shape(self._canonical_model_state, self.initial_model_state)

    def _canonical_avals(self) -> TrainState:
        params = self.treedef.unflatten([jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in self.leaves])
        return canonical_avals(self.optimizer, params, self._model_avals())

    @on_own_mesh
    def canonical_target(self) -> TrainState:
        """The canonical state's ShapeDtypeStructs with shardings (what a checkpoint restores onto)."""
        return with_shardings(self._canonical_avals(), self.canonical_shardings())

    @on_own_mesh
    def canonical(self, state: TrainState) -> TrainState:
        """`state` in the canonical form (single-device shapes and order), resharded inside jit."""
        return self._canonical_fn(state)

    @functools.cached_property
    def _canonical_fn(self):
        # built once: a new jit per call would retrace and recompile at every checkpoint
        return jax.jit(self._to_canonical, out_shardings=self.canonical_shardings())

    @on_own_mesh
    def from_canonical(self, tree: TrainState) -> TrainState:
        """This run's state from a canonical one (e.g. restored from a checkpoint of another layout)."""
        check_canonical(tree, self._canonical_avals(), "Parallel")
        return jax.jit(self._from_canonical, out_shardings=self.state_shardings)(on_auto_axes(tree))

    def _reorder(self, tree, convert):
        """Apply `convert(x, tp_dim, groups, tp)` to every parameter and every optimizer leaf holding a
        parameter's values along its tp dimension (`_opt_tp_dims`)."""
        tp = self.cfg.tp
        params, opt = tree
        xs = jax.tree.leaves(params)
        params = self.treedef.unflatten(
            [convert(x, leaf.tp_dim, leaf.groups, tp) for x, leaf in zip(xs, self.leaves, strict=True)]
        )
        opt_leaves, opt_def = jax.tree.flatten(opt)
        placed = [
            x if k is None else convert(x, dim, self.leaves[k].groups, tp)
            for x, (k, dim) in zip(opt_leaves, self._opt_tp_dims(opt), strict=True)
        ]
        return params, opt_def.unflatten(placed)

    def _opt_tp_dims(self, opt) -> list[tuple[int | None, int | None]]:
        """For each optimizer leaf, `(k, dim)`: it holds parameter k's values along k's reordered tp dimension
        in its dimension `dim` (a mirror such as Adam's moments, or a statistic with one dimension reduced
        away such as Adafactor's row and column moments), else `(None, None)`. Only grouped columns (fused
        q/k/v) are stored in another order; a leaf of one whose order cannot be derived is refused."""
        out = []
        paths = jax.tree_util.tree_flatten_with_path(opt)[0]
        by_path = owners(opt, self.treedef.unflatten(self.leaves), same_shape=False)
        for (kp, x), k in zip(paths, by_path, strict=True):
            leaf = None if k is None else self.leaves[k]
            if leaf is None or leaf.tp_dim is None or leaf.groups == 1 or self.cfg.tp == 1:
                out.append((None, None))
            elif tuple(x.shape) == tuple(leaf.shape):
                out.append((k, leaf.tp_dim))
            elif leaf.shape[leaf.tp_dim] not in x.shape:  # e.g. a placeholder: no values along the tp dimension
                out.append((None, None))
            else:
                removed = [d for d in range(len(leaf.shape)) if leaf.shape[:d] + leaf.shape[d + 1 :] == tuple(x.shape)]
                dims = {None if d == leaf.tp_dim else leaf.tp_dim - (d < leaf.tp_dim) for d in removed}
                if len(dims) != 1:
                    raise ValueError(
                        f"Parallel.canonical: the optimizer state leaf {jax.tree_util.keystr(kp)} {list(x.shape)} of "
                        f"{leaf.name} {list(leaf.shape)}, whose fused columns tp stores in another order, is not the "
                        "parameter's shape nor that shape with one dimension removed, so its canonical order is "
                        "unknown; use an optimizer whose state mirrors the parameters (adam, sgd, adafactor) or tp=1"
                    )
                dim = dims.pop()
                out.append((None, None) if dim is None else (k, dim))
        return out

    def _to_canonical(self, state: TrainState) -> TrainState:
        # into the canonical shardings first: a grouped column's tp dimension is then whole on each device,
        # so its reorder is local (left to XLA, the reorder ran on the stored sharding and was followed by a
        # full rematerialization per leaf, with a warning each)
        target = self.canonical_shardings()
        placed = jax.lax.with_sharding_constraint((state.params, state.opt_state), (target.params, target.opt_state))
        params, opt = self._reorder(placed, from_storage)
        return TrainState(params, opt, state.step, self._canonical_model_state(state.model_state))

    def _from_canonical(self, tree: TrainState) -> TrainState:
        params, opt = self._reorder((tree.params, tree.opt_state), to_storage)
        return TrainState(params, opt, tree.step, self._own_model_state(tree.model_state))

    def _canonical_model_state(self, model_state) -> dict:
        """The model's variables as one pure dict (as DDP stores them): the blocks' under the blocks' name."""
        out = dict(model_state["outer"])
        blocks = {i: b for i, b in model_state["blocks"].items() if jax.tree.leaves(b)}
        if blocks:
            out[self.units.blocks] = blocks
        return out

    def _own_model_state(self, canonical: dict) -> dict:
        outer = {k: v for k, v in canonical.items() if k != self.units.blocks}
        placed = canonical.get(self.units.blocks, {})
        blocks = {i: placed.get(i, {}) for i in range(self.n_blocks)} if self.block_states is not None else {}
        return {"outer": outer, "blocks": blocks}

    # -- units as functions of their local parameter pieces ----------------------------

    _trace_backend: str | None = None  # set while `_decide_tp_sums` traces

    def _binding(self) -> Binding:
        cfg = self.cfg
        backend = self._trace_backend or cfg.backend
        return Binding(cfg.tp_axis, cfg.tp, backend, cfg.sequence_parallel, self.sequence_dim)

    def _bound(self, module, prefix=()):
        if self.placements is not None:
            bind(module, self.placements, self._binding(), prefix)
        return module

    @model_sharding_dropped()  # the units' code on one rank's shapes: the model's own sharding annotations are no-ops
    def _decide_tp_sums(self, x_aval) -> dict:
        """Per unit ("embed", "head", block i), the replicated parameters whose gradient is summed over
        tp: those acting on values that differ per tp rank (`jaxdist.tp.grads`, from JAX's types)."""
        cfg, units, state = self.cfg, self.units, self.initial_model_state
        shape = list(x_aval.shape)
        if cfg.sequence_parallel:
            shape[self.sequence_dim] //= cfg.tp
        x = jax.ShapeDtypeStruct(tuple(shape), x_aval.dtype)
        names = {k: leaf.name for k, leaf in enumerate(self.leaves)}

        def decide(unit, ks, x, stored, who, *, layer=False, out_may_vary=False):
            skip = 1 if layer else 0  # one layer of a stacked leaf
            ws = {k: jax.ShapeDtypeStruct(self.leaves[k].local[skip:], self.leaves[k].dtype) for k in ks}
            split = frozenset(k for k in ks if self.leaves[k].tp_dim is not None)
            return tp_summed(
                unit,
                ws,
                x,
                (self.local_batch, stored),
                mesh=self.mesh,
                axis=cfg.tp_axis,
                split=split,
                x_varies=cfg.sequence_parallel,
                out_may_vary=out_may_vary,
                names=names,
                who=who,
            )

        self._trace_backend = "xla"  # the type trace is never compiled; jax.lax collectives carry the types
        try:
            embed = lambda ws, _, e: self._outer_apply(ws, e[1], lambda m: units.embed(m, e[0]))[0]
            head = lambda ws, x, e: self._head(ws, x, e[0], e[1], summed=False)[0]
            sums = {
                "embed": decide(embed, self.embed_leaves, None, state["outer"], "the embed"),
                "head": decide(head, self.head_leaves, x, state["outer"], "the head"),
            }
            seen = {}  # blocks of one definition and piece shapes run one program: trace it once
            for i in range(self.n_blocks):
                ks = self.block_leaves[i]
                same = (self.block_kinds[i], tuple((self.leaves[k].local, self.leaves[k].tp_dim) for k in ks))
                if same not in seen:
                    stored = state["blocks"][i] if self.block_states is not None else None
                    block = lambda ws, x, e, i=i: self._block(i, ws, x, e[0], e[1], summed=False)[0]
                    summed = decide(
                        block, ks, x, stored, f"block {i}", layer=units.stacked, out_may_vary=cfg.sequence_parallel
                    )
                    seen[same] = (ks, summed)
                first, summed = seen[same]
                sums[i] = frozenset(k for k, k0 in zip(ks, first, strict=True) if k0 in summed)
        finally:
            self._trace_backend = None
        return sums

    def _summed(self, ws: dict, unit) -> dict:
        """The unit's pieces, those of `tp_sums[unit]` with their gradient summed over tp in backward."""
        summed = self.tp_sums.get(unit, ())
        cfg = self.cfg
        return {k: tp_math.copy_to_tp(w, cfg.tp_axis, cfg.backend) if k in summed else w for k, w in ws.items()}

    @model_sharding_dropped()
    def _outer_apply(self, ws: dict, stored, fn, bound: bool = True):
        """`fn(model)` on the model holding the given outer pieces, zeros elsewhere (never read; XLA
        drops them) and the outer variables `stored`; returns `(out, the outer variables after)`.
        `bound=False` (tracing outside the mesh, for shapes and reads) takes whole parameters and
        leaves the layers unbound: the model as on one device."""
        shape = (lambda leaf: leaf.local) if bound else (lambda leaf: leaf.shape)
        xs = [ws[k] if k in ws else jnp.zeros(shape(leaf), leaf.dtype) for k, leaf in enumerate(self.leaves)]
        run = lambda model: fn(self._bound(model) if bound else model)
        return self.outer_state.apply(self.graphdef, self.treedef.unflatten(xs), stored, run, fixed=self.blocks_fixed)

    def _embed(self, ws, batch, stored):
        x, after = self._outer_apply(self._summed(ws, "embed"), stored, lambda m: self.units.embed(m, batch))
        if self.cfg.sequence_parallel:
            x = tp_math.split_sequence(x, self.cfg.tp_axis, self.cfg.backend, self.sequence_dim)
        return x, after

    def _head(self, ws, x, batch, stored, summed: bool = True):
        """`(total, (count or None, aux or None, the outer variables after))` of the head's loss;
        `summed=False` leaves out the gradient sums over tp (`_summed`)."""
        units = self.units
        ws = self._summed(ws, "head") if summed else ws
        out, after = self._outer_apply(ws, stored, lambda m: units.head_loss(m, x, batch))
        loss, aux = out if units.has_aux else (out, None)
        total, count = loss if units.sum_and_count else (loss, None)
        return total, (count, aux, after)

    @model_sharding_dropped()
    def _block(self, i: int, ws: dict, x, batch, stored, summed: bool = True):
        """Block i on its pieces and its variables `stored`: `(y, its variables after)`."""
        ws = self._summed(ws, i) if summed else ws
        pure = self.block_trees[i].unflatten([ws[k] for k in self.block_leaves[i]])
        call = self.units.block_call
        run = lambda block: self._block_call(i, self._bound(block, self._block_prefix(i)), x, batch, call)
        if self.block_states is None:
            return run(nnx.merge(self.block_defs[i], pure, self.block_rests[i])), None
        return self.block_states[i].apply(self.block_defs[i], pure, stored, run)

    def _block_call(self, i, block, x, batch, call):
        y = call(block, x, batch) if call is not None else block(x)
        if getattr(y, "shape", None) != x.shape:
            shape = getattr(y, "shape", type(y).__name__)
            raise ValueError(
                f"Parallel: block {i} returned {shape} for activations of shape {x.shape}; pass "
                "Units(block_call=...) returning the activations, e.g. `lambda blk, x, b: blk(x, b['pos'])[1]`"
            )
        return y

    def _reads(self, fn, indices) -> set[int]:
        """The leaves among `indices` that `fn(pieces, batch)` reads."""
        jaxpr = jax.make_jaxpr(fn)(self._avals(indices, whole=True), self.local_batch).jaxpr
        used = {v for eqn in jaxpr.eqns for v in eqn.invars if isinstance(v, jax.extend.core.Var)}
        used |= {v for v in jaxpr.outvars if isinstance(v, jax.extend.core.Var)}
        order = sorted(indices)  # dict pytrees flatten in key order
        return {k for k, v in zip(order, jaxpr.invars[: len(order)], strict=True) if v in used}

    # -- communication of a unit's pieces -------------------------------------------------

    def _ops(self) -> tuple[AsyncOp, AsyncOp]:
        cfg = self.cfg
        axis = cfg.storage_axis
        others = tuple(a for a in cfg.data_axes if a != axis)
        over = (axis, *others) if axis else others  # what a piece kept whole over the storage axis is reduced over

        def buffers(arrays: dict, sharded: bool) -> list[list]:
            """The keys of the pieces sharded over the storage axis (or of those kept whole, when there is
            something to reduce them over), one group per dtype: each group is one communication buffer.
            The wait recomputes them from the values its handle carries, so a handle holds arrays only."""
            if not sharded and not over:
                return []
            keys = [k for k in sorted(arrays) if (self._store_dim(k, arrays[k]) is not None) == sharded]
            return by_dtype(keys, arrays)

        def gather_start(ws: dict, tok):
            # pieces tied first: a unit gathered again for backward packs its own copy, which XLA cannot
            # merge (CSE) with the forward's and keep alive from forward to backward
            ws, tok = comm.tie(ws, tok)
            ws = self._in_compute_dtype(ws)  # before the gather: the collective moves the compute dtype
            handles = []
            for ks in buffers(ws, sharded=True):
                flat = jnp.concatenate([ws[k].reshape(-1) for k in ks])
                h, tok = comm.all_gather_start(flat, axis, tok, tiled=False, backend=cfg.backend)
                handles.append(h)
            return (handles, ws), tok

        def gather_wait(handle, tok):
            handles, ws = handle
            out = dict(ws)
            for ks, h in zip(buffers(ws, sharded=True), handles, strict=True):
                stacked, tok = comm.wait(h, tok)  # (n, S): every storage rank's pieces
                offset = 0
                for k in ks:
                    size = ws[k].size
                    part = stacked[:, offset : offset + size].reshape(stacked.shape[0], *ws[k].shape)
                    out[k] = jnp.concatenate(list(part), axis=self._store_dim(k, ws[k])) if len(part) > 1 else part[0]
                    offset += size
            return out, tok

        def reduce_start(gs: dict, tok):
            if cfg.reduce_dtype is not None:
                gs = {k: g.astype(cfg.reduce_dtype) for k, g in gs.items()}
            n = cfg._size(axis) if axis else 1
            scattered, reduced = [], []
            for ks in buffers(gs, sharded=True):
                chunks = []
                for k in ks:
                    g, d = gs[k], self._store_dim(k, gs[k])
                    g = g.reshape(*g.shape[:d], n, g.shape[d] // n, *g.shape[d + 1 :])
                    chunks.append(jnp.moveaxis(g, d, 0).reshape(n, -1))
                packed = jnp.concatenate(chunks, axis=1)
                h, tok = comm.reduce_scatter_start(packed, axis, tok, op="mean", backend=cfg.backend)
                scattered.append(h)
            for ks in buffers(gs, sharded=False):
                flat = jnp.concatenate([gs[k].reshape(-1) for k in ks])
                h, tok = comm.all_reduce_start(flat, _axes(over), tok, op="mean", backend=cfg.backend)
                reduced.append(h)
            return (scattered, reduced, gs), tok

        def reduce_wait(handle, tok):
            scattered, reduced, gs = handle
            out = dict(gs)
            for ks, h in zip(buffers(gs, sharded=True), scattered, strict=True):
                flat, tok = comm.wait(h, tok)
                flat = flat.reshape(-1)
                if others:
                    flat, tok = comm.all_reduce(flat, _axes(others), tok, op="mean", backend=cfg.backend)
                offset = 0
                for k in ks:
                    shape = list(gs[k].shape)
                    shape[self._store_dim(k, gs[k])] //= cfg._size(axis)
                    size = int(np.prod(shape))
                    out[k] = flat[offset : offset + size].reshape(shape)
                    offset += size
            for ks, h in zip(buffers(gs, sharded=False), reduced, strict=True):
                flat, tok = comm.wait(h, tok)
                offset = 0
                for k in ks:
                    out[k] = flat[offset : offset + gs[k].size].reshape(gs[k].shape)
                    offset += gs[k].size
            return out, tok

        return (
            AsyncOp(gather_start, gather_wait, "engine.gather"),
            AsyncOp(reduce_start, reduce_wait, "engine.reduce"),
        )

    def _in_compute_dtype(self, ws: dict) -> dict:
        dtype = self.cfg.compute_dtype
        if dtype is None:
            return ws
        cast = lambda w: w.astype(dtype) if jnp.issubdtype(w.dtype, jnp.floating) else w
        return {k: cast(w) for k, w in ws.items()}

    # -- the step -------------------------------------------------------------------------

    def _batch_spec(self) -> P:
        return P(_axes(self.cfg.batch_axes)) if self.cfg.batch_axes else P()

    def _per_device(self, params, model_state, step, batch, *opt_state):
        """`_local_grads` on this device's batch: under cp its rank's chunks of the sequence, with the
        model's attention over the whole context (`jaxdist.cp`)."""
        cfg = self.cfg
        if cfg.cp == 1:
            return self._local_grads(params, model_state, step, batch, *opt_state)
        rank = jax.lax.axis_index(cfg.cp_axis)
        batch = cp.local_batch(batch, rank, cfg.cp, self.cp_length, cfg.cp_whole)
        with cp.attention_over(cfg.cp_axis, cfg.cp, self.cp_length, cfg.backend, type(cfg).__name__):
            return self._local_grads(params, model_state, step, batch, *opt_state)

    def _step(self, state: TrainState, batch):
        cfg = self.cfg
        batch_spec = self._batch_spec()
        batch = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, self._sharding(batch_spec)), batch)
        specs = self._param_specs()
        metrics_spec = {"loss": P()}
        if self.aux_specs is not None:
            metrics_spec["aux"] = self.aux_specs
        if cfg.record_weights:
            metrics_spec["weights_used"] = metrics_spec["weights_used_backward"] = P()
        if cfg.update_in_backward:  # the optimizer runs inside, unit by unit
            opt_specs = jax.tree.map(lambda s: s.spec, self.state_shardings.opt_state)
            body = jax.shard_map(
                self._per_device,
                mesh=self.mesh,
                in_specs=(specs, P(), P(), batch_spec, opt_specs),
                out_specs=((specs, opt_specs), P(), metrics_spec),
                check_vma=False,
            )
            (params, opt_state), model_state, metrics = body(
                state.params, state.model_state, state.step, batch, state.opt_state
            )
            new = TrainState(params, opt_state, state.step + 1, model_state)
            return new, {**metrics, "grad_norm": jnp.float32(jnp.nan), "skipped": jnp.zeros((), jnp.bool_)}
        body = jax.shard_map(
            self._per_device,
            mesh=self.mesh,
            in_specs=(specs, P(), P(), batch_spec),
            out_specs=(specs, P(), metrics_spec),
            # the rank's program as written: its data-axis reductions are explicit, and the sums over tp
            # that JAX's types would add are decided at prepare (`_decide_tp_sums`)
            check_vma=False,
        )
        grads, model_state, metrics = body(state.params, state.model_state, state.step, batch)
        params, opt_state, norm, skipped = optimizer_step(
            self.optimizer,
            state.params,
            state.opt_state,
            grads,
            max_grad_norm=cfg.max_grad_norm,
            skip_nonfinite=cfg.skips_nonfinite,
        )
        if cfg.skips_nonfinite:
            model_state = keep_if(skipped, model_state, state.model_state)
        params = jax.lax.with_sharding_constraint(params, self.state_shardings.params)
        opt_state = jax.lax.with_sharding_constraint(opt_state, self.state_shardings.opt_state)
        new = TrainState(params, opt_state, state.step + 1, model_state)
        return new, {**metrics, "grad_norm": norm, "skipped": skipped}

    @model_sharding_dropped()  # the per-device program: the model's own sharding annotations are no-ops
    def _local_grads(self, params, model_state, step, batch, opt_state=None):
        """This rank's gradient pieces; with `opt_state` (update_in_backward) the updated
        parameters and optimizer state instead, each unit updated as soon as it is reduced."""
        cfg = self.cfg
        in_backward = opt_state is not None
        if in_backward:
            update = lambda gs, acc, layer=None: self._update_unit(gs, acc, params, opt_state, layer)
        # RNG streams folded with the step and this data rank (every tp rank of it draws the same)
        rank = jax.lax.axis_index(_axes(cfg.data_axes)) if cfg.data_axes else 0
        outer_in = self.outer_state.for_step(model_state["outer"], rank, step)
        # under sequence parallelism a block sees only values that differ per tp rank (its chunk of the
        # tokens, then its heads / features), so each tp rank draws its own masks, as one device draws
        # one per token; without it the activations between tp layers are whole and every tp rank must
        # draw the same
        block_rank = rank * cfg.tp + jax.lax.axis_index(cfg.tp_axis) if cfg.sequence_parallel else rank
        blocks_in = [
            ms.for_step(model_state["blocks"][i], block_rank, step) for i, ms in enumerate(self.block_states or [])
        ]
        gather, reduce = self._ops()
        pieces = dict(enumerate(jax.tree.leaves(params)))
        unit = lambda ks: {k: pieces[k] for k in ks}
        if self.units.stacked:  # block i: layer i of every stacked leaf
            block_unit = lambda i: {k: pieces[k][i] for k in self.block_leaves[i]}
        else:
            block_unit = lambda i: unit(self.block_leaves[i])
        tok = comm.token()

        # forward: the embedding, then block i+1 gathered while block i computes
        embed_w, tok = _fetch(gather, unit(self.embed_leaves), tok)
        x0, embed_vjp, outer_mid = jax.vjp(lambda w: self._embed(w, batch, outer_in), embed_w, has_aux=True)
        saved_x, saved_w, used, blocks_out = [], [], [], []
        mode = cfg.backward_residuals
        side = lambda i: (batch, blocks_in[i] if blocks_in else None)  # the block's inputs besides w and x
        block_side_fn = lambda i: lambda w, x, side: self._block(i, w, x, *side)

        def block_fn(i):
            fn = lambda w, x: block_side_fn(i)(w, x, side(i))
            return jax.checkpoint(fn) if cfg.remat else fn

        saved_vjp = []

        def forward(i, w, x):
            saved_x.append(x)
            saved_w.append(w)  # dropped by XLA when backward gathers again
            if cfg.record_weights:
                used.append(self._weight_sum(w))
            if mode == "recompute":  # backward recomputes on re-gathered weights: keep no residual of them
                y, after = block_fn(i)(w, x)
            else:  # the residuals as plain autodiff keeps them
                y, vjp, after = jax.vjp(block_fn(i), w, x, has_aux=True)
                if mode == "rebuild":  # but none computed from the weights alone: those hold the gathered weights
                    leaves, tree = jax.tree.flatten(vjp)
                    drop = self._weight_only(i, block_side_fn(i), w, x, side(i))
                    if len(drop) != len(leaves):
                        raise AssertionError(f"block {i}: {len(leaves)} residuals, the analysis traced {len(drop)}")
                    vjp = (tree, [None if d else leaf for leaf, d in zip(leaves, drop, strict=True)])
                saved_vjp.append(vjp)
            blocks_out.append(after)
            return y, None, None

        xl, tok, _, _ = pipelined_loop(
            forward,
            x0,
            self.n_blocks,
            tok,
            fetch=gather,
            fetch_input=lambda i, _: block_unit(i),
            depth=min(cfg.prefetch, self.n_blocks),
            unroll=True,
        )
        head_w, tok = _fetch(gather, unit(self.head_leaves), tok)
        total, head_vjp, (count, aux, outer_out) = jax.vjp(
            lambda w, x: self._head(w, x, batch, outer_mid), head_w, xl, has_aux=True
        )
        seed = jnp.ones_like(total)
        if count is not None:  # d(global sum / global count): the data-rank mean below restores the sum
            count = count.astype(jnp.float32)
            if cfg.data_axes:
                count, tok = comm.all_reduce(count, _axes(cfg.data_axes), tok, op="sum", backend=cfg.backend)
            seed = (seed * self.n_data / count).astype(total.dtype)
        d_head, dx = head_vjp(seed)
        tied = {k: d_head.pop(k) for k in self.tied}
        head_handle, tok = reduce.start(d_head, tok) if d_head else (None, tok)

        # backward: block i-1 fetched and block i+1's gradients reduced while block i computes
        def backward(i, w, carry):
            y = self._weight_sum(w) if cfg.record_weights else None
            if mode == "kept":
                dw, dx_in = saved_vjp[i](carry)
                return dx_in, dw, y
            if mode == "rebuild":
                # the weights' own residuals from the re-gathered weights (values XLA cannot merge with the
                # forward's: each gather packs its own copy); only their equations run, none reads x
                tree, kept_leaves = saved_vjp[i]
                drop = [k is None for k in kept_leaves]
                x_aval = jax.ShapeDtypeStruct(saved_x[i].shape, saved_x[i].dtype)
                fresh = weight_only_values(block_side_fn(i), w, x_aval, side(i), drop)
                dw, dx_in = rebuild(tree, kept_leaves, fresh)(carry)
                return dx_in, dw, y
            # replayed on the saved input, which rides in the carry: tied like the gradient, after the
            # next gather was issued, so the replay runs no earlier, on a value XLA cannot merge (CSE)
            # with the forward's (nothing of the forward is kept for it, as after remat); the same
            # inputs and variables as forward: the same dropout masks
            dx, x = carry
            _, vjp, _ = jax.vjp(block_fn(i), w, x, has_aux=True)
            dw, dx_in = vjp(dx)
            return (dx_in, saved_x[i - 1] if i else x), dw, y

        def finish(i, g, acc, tok):
            if in_backward:
                return update(g, acc, i if self.units.stacked else None), tok
            return {**acc, i: g}, tok

        fetch = gather if cfg.regather else kept("engine.kept")
        fetch_input = (lambda i, _: block_unit(i)) if cfg.regather else (lambda i, _: saved_w[i])
        dx0, tok, per_block, used_backward = pipelined_loop(
            backward,
            (dx, saved_x[-1]) if mode == "recompute" else dx,
            self.n_blocks,
            tok,
            fetch=fetch,
            fetch_input=fetch_input,
            emit=reduce,
            finish=finish,
            acc=(jax.tree.leaves(params), jax.tree.leaves(opt_state)) if in_backward else {},
            depth=min(cfg.prefetch, self.n_blocks),
            reverse=True,
            unroll=True,
        )
        if mode == "recompute":
            dx0 = dx0[0]
        if in_backward:
            grads = {}
        elif self.units.stacked:  # the stacked leaves' gradients, layer by layer
            grads = {k: jnp.stack([per_block[i][k] for i in range(self.n_blocks)]) for k in self.block_leaves[0]}
        else:
            grads = {k: g for i in range(self.n_blocks) for k, g in per_block[i].items()}
        (d_embed,) = embed_vjp(dx0)
        d_embed = {k: g + tied[k] if k in tied else g for k, g in d_embed.items()}
        g_embed, tok = _fetch(reduce, d_embed, tok)
        grads = {**grads, **g_embed}
        if head_handle is not None:
            g_head, tok = reduce.wait(head_handle, tok)
            grads.update(g_head)
        if in_backward:
            new_params, new_opt = update(grads, per_block)
        loss = total.astype(jnp.float32)  # reported in float32 whatever the compute dtype
        if cfg.data_axes:
            op = "mean" if count is None else "sum"
            loss, tok = comm.all_reduce(loss, _axes(cfg.data_axes), tok, op=op, backend=cfg.backend)
        if count is not None:
            loss = loss / count.astype(loss.dtype)
        metrics = {"loss": loss}
        if aux is not None:
            aux, tok = self._reduce_aux(aux, tok)
            metrics["aux"] = aux
        if cfg.record_weights:
            for key, sums in (("weights_used", jnp.stack(used)), ("weights_used_backward", used_backward)):
                if cfg.tp > 1:
                    sums, tok = comm.all_reduce(sums, cfg.tp_axis, tok, op="sum", backend=cfg.backend)
                metrics[key] = sums
        new_model_state, tok = self._model_state_after(model_state, outer_out, blocks_out, tok)
        if in_backward:
            updated = (self.treedef.unflatten(new_params), jax.tree.structure(opt_state).unflatten(new_opt))
            return updated, new_model_state, metrics
        out = [grads[k].astype(self.leaves[k].dtype) for k in range(len(self.leaves))]
        return self.treedef.unflatten(out), new_model_state, metrics

    def _update_unit(self, gs: dict, acc, params, opt_state, layer=None):
        """update_in_backward: the leaves `gs` names (layer `layer` of stacked ones) updated from the
        step's values, into `acc` = (parameter leaves, optimizer state leaves). The optimizer runs on
        the whole tree with zero gradients elsewhere, results XLA drops: exact for the per-leaf
        transformations `prepare` admits (`jaxdist.core.per_leaf`); shared state (a count) is the same
        from every unit."""
        new_p, new_s = list(acc[0]), list(acc[1])
        sliced = lambda k: layer is not None and k in gs
        piece = lambda x, k: x[layer] if sliced(k) else x
        p_in = [piece(x, k) for k, x in enumerate(jax.tree.leaves(params))]
        g_in = [gs[k].astype(x.dtype) if k in gs else jnp.zeros_like(x) for k, x in enumerate(p_in)]
        s_in = [piece(x, o) for x, o in zip(jax.tree.leaves(opt_state), self.opt_owners, strict=True)]
        tree, s_tree = self.treedef.unflatten, jax.tree.structure(opt_state)
        updates, s_out = self.optimizer.update(tree(g_in), s_tree.unflatten(s_in), tree(p_in))
        p_out = jax.tree.leaves(optax.apply_updates(tree(p_in), updates))
        put = lambda whole, k, x: whole.at[layer].set(x) if sliced(k) else x
        for k in gs:
            new_p[k] = put(new_p[k], k, p_out[k])
        for j, (o, x) in enumerate(zip(self.opt_owners, jax.tree.leaves(s_out), strict=True)):
            if o is None or o in gs:
                new_s[j] = put(new_s[j], o, x)
        return new_p, new_s

    def _model_state_after(self, before, outer_out, blocks_out, tok):
        """What the step stores (`ModelState.after_step`): batch statistics averaged over the mesh (the
        data ranks' local statistics; tp ranks hold equal ones, or sequence chunks' under sequence
        parallelism), RNG keys as they were, other variables as the forward left them."""
        axes, backend = _axes(self.cfg.mesh.axis_names), self.cfg.backend
        outer, tok = self.outer_state.after_step(before["outer"], outer_out, axes, tok, backend)
        blocks = {}
        for i, ms in enumerate(self.block_states or []):
            blocks[i], tok = ms.after_step(before["blocks"][i], blocks_out[i], axes, tok, backend)
        return {"outer": outer, "blocks": blocks}, tok

    def _reduce_aux(self, aux, tok):
        """Average the scalar-like aux leaves over the data ranks (per-example ones leave as they are)."""
        leaves, tree = jax.tree.flatten(aux)
        specs = jax.tree.leaves(self.aux_specs, is_leaf=lambda s: isinstance(s, P))
        out = []
        for x, spec in zip(leaves, specs, strict=True):
            if spec == P() and self.cfg.data_axes:
                x, tok = comm.all_reduce(
                    x.astype(jnp.float32), _axes(self.cfg.data_axes), tok, op="mean", backend=self.cfg.backend
                )
            out.append(x)
        return tree.unflatten(out), tok

    def _weight_only(self, i: int, fn, w, x, side) -> tuple[bool, ...]:
        """Which residuals of block i's vjp are functions of its weights alone (`jaxdist.engine.residuals`),
        traced once per block definition and shapes (blocks of one definition run one program)."""
        avals = tuple((a.shape, a.dtype) for a in jax.tree.leaves((w, x, side)))
        key = (self.block_kinds[i], len(w), jax.tree.structure((x, side)), avals)
        if key not in self._weight_only_cache:
            self._weight_only_cache[key] = weight_only(fn, w, x, side)
        return self._weight_only_cache[key]

    def _weight_sum(self, ws: dict):
        """Sum of a unit's gathered weights, replicated pieces counted once over tp."""
        tp = self.cfg.tp
        return sum(jnp.sum(w.astype(jnp.float32)) / (tp if self.leaves[k].tp_dim is None else 1) for k, w in ws.items())


def same_definition(a: nnx.GraphDef, b: nnx.GraphDef) -> bool:
    """Whether two blocks' definitions (code and static attributes) are equal. Compared, never hashed:
    a block may hold an unhashable attribute (a plain dataclass config); an attribute whose comparison
    fails (an array's) counts as different."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def definition_kinds(defs: list[nnx.GraphDef]) -> list[int]:
    """For each definition, the index of the first one equal to it: blocks of one kind run one program
    (traced once); the index, not the definition, keys what is traced per kind."""
    firsts: list[int] = []
    kinds = []
    for i, d in enumerate(defs):
        kind = next((j for j in firsts if same_definition(defs[j], d)), None)
        if kind is None:
            firsts.append(i)
            kind = i
        kinds.append(kind)
    return kinds


def by_dtype(keys: list, arrays: dict) -> list[list]:
    """`keys` (in their order) grouped by the dtype of `arrays[k]`, one group per dtype: each group is one
    communication buffer, since a buffer concatenated from mixed dtypes would promote them all (a bfloat16
    weight gathered, and computed with, as float32)."""
    groups: dict = {}
    for k in keys:
        groups.setdefault(jnp.dtype(arrays[k].dtype), []).append(k)
    return [groups[d] for d in sorted(groups, key=str)]


def _fetch(op: AsyncOp, value, tok):
    h, tok = op.start(value, tok)
    return op.wait(h, tok)


def _axes(axes: tuple[str, ...]):
    return axes[0] if len(axes) == 1 else axes


def _sequence_dim(cfg: Parallel, shape: tuple[int, ...]) -> int:
    """The activations' dimension sequence parallelism splits over tp (1 when it is off: unused)."""
    if not cfg.sequence_parallel:
        return 1
    if cfg.sequence_dim is None:
        dim = 0 if shape and shape[0] % cfg.tp == 0 else 1
    else:
        dim = cfg.sequence_dim
    if not 0 <= dim < len(shape) - 1 or shape[dim] % cfg.tp:
        raise ValueError(
            f"Parallel: sequence_parallel splits dimension {dim} of the activations {shape} over tp={cfg.tp}; "
            "it must be a token dimension (not the last, the features) that tp divides: change the batch or "
            "sequence length, pass sequence_dim, or turn sequence_parallel off"
        )
    return dim
