"""The unit engine's options: how a model splits into units (`Units`) and how training spreads over
the mesh (`Options`, which `jaxdist.engine.Parallel` extends with `prepare`), with the roles and axes
derived from them that every other part of the engine reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxdist.core.step import local_batch_avals
from jaxdist.engine.prefetch import check_buffers
from jaxdist.tp.plan import TPPlan


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
class Options:
    """The options of DP x FSDP x TP training over the mesh axes that exist (`jaxdist.engine.Parallel`
    is these options and `prepare`).

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
      pack_units: True (default) packs a unit's pieces into one flat buffer per dtype for each
        gather and reduction (copies in and out); False communicates them as grouped collectives
        over the pieces themselves (`jaxdist.comm` groups: one NCCL group each with the nccl
        backend, ops XLA's combiners merge with the xla backend), with no packing copies: a unit's
        gather is one group; its reduction a reduce-scatter group (then an all-reduce group over
        the other data axes) and an all-reduce group of its unsharded pieces. With the nccl backend
        a piece stored along a dimension other than its first is transposed on the way in and out
        (NCCL splits the leading dimension). In a pipeline it also covers the stage gradients'
        all-reduce over the data axes; the messages between stages stay packed.
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
    pack_units: bool = True
    cp_axis: str = "cp"
    cp_whole: tuple[str, ...] = ("segment_ids",)

    def __post_init__(self):
        names = self.mesh.axis_names
        roles = self.axis_roles()
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
        """Whether a step with a NaN/Inf gradient norm or loss is skipped (`skip_nonfinite`, resolved)."""
        return self.skip_nonfinite if self.skip_nonfinite is not None else not self.update_in_backward

    def axis_roles(self) -> dict[str, str]:
        """The mesh axis of each role these options place work on (a subclass adding an axis extends it)."""
        return {"dp_axis": self.dp_axis, "fsdp_axis": self.fsdp_axis, "tp_axis": self.tp_axis, "cp_axis": self.cp_axis}

    def size(self, axis: str) -> int:
        """The size of mesh axis `axis`; 1 for an axis the mesh does not have."""
        return self.mesh.shape[axis] if axis in self.mesh.axis_names else 1

    @property
    def tp(self) -> int:
        """The tensor-parallel size."""
        return self.size(self.tp_axis)

    @property
    def cp(self) -> int:
        """The context-parallel size."""
        return self.size(self.cp_axis)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The data axes of size > 1 (an axis of size 1 would only add no-op collectives and the
        packing of their buffers to every step); cp is one: its ranks hold other tokens of the batch."""
        return tuple(a for a in (self.dp_axis, self.fsdp_axis, self.cp_axis) if self.size(a) > 1)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The data axes the batch's rows split over (cp splits the sequence instead)."""
        return tuple(a for a in self.data_axes if a != self.cp_axis)

    @property
    def data_ranks(self) -> int:
        """How many ranks the loss and gradients average over: the product of the data axes' sizes."""
        return int(np.prod([self.size(a) for a in self.data_axes]))

    @property
    def batch_spec(self) -> P:
        """Where the batch (and a per-example value) lives: its leading dimension split over the batch axes."""
        return P(axis_arg(self.batch_axes)) if self.batch_axes else P()

    def local_batch(self, batch):
        """One data rank's avals of a global `batch` (prepare's example or a step's), the whole sequence
        (cp cuts it inside the step); a batch that does not split over the batch axes raises, naming the
        fix. A strategy that splits the batch further (the pipeline's micro-batches) checks that here too."""
        rows = int(np.prod([self.size(a) for a in self.batch_axes]))
        fix = f"the {rows} devices of the data axes {self.batch_axes}; change the batch size"
        return local_batch_avals(batch, rows, type(self).__name__, fix)

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
        """Whether backward gathers each unit again (ZeRO-3 resharding after forward)."""
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


def axis_arg(axes: tuple[str, ...]):
    """`axes` as a collective's axis argument: the name of a single axis, else the tuple."""
    return axes[0] if len(axes) == 1 else axes
