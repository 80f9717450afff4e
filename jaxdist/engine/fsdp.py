"""FSDP (ZeRO-3) with double buffering: the unit engine with parameters sharded over one data axis.

`FSDP(mesh, ...)` is a configuration of `jaxdist.engine.Parallel` (an `fsdp`
axis, an optional replica axis for HSDP, no tensor parallelism): each
parameter is stored in its own shape, sharded over `axis`, with the optimizer
state mirroring it. Forward gathers unit i+1 while unit i computes and drops
gathered weights after use; backward re-gathers unit i-1 while unit i computes
its gradients (recomputing unit i's forward, or with `remat=False` rebuilding
only the residuals of its weights alone) and reduce-scatters unit i's gradients
while unit i-1 runs. Both
are the engine's `jaxdist.engine.prefetch.pipelined_loop`, whose carry holds exactly
`buffers - 1` in-flight units.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax
from flax import nnx

from jaxdist.engine.run import Parallel, ParallelRun, Units

__all__ = ["FSDP"]


@dataclasses.dataclass(frozen=True)
class FSDP:
    """Options of fully sharded data parallelism over the mesh axis `axis`.

    Attributes:
      mesh: the device mesh.
      axis: the mesh axis parameters are sharded over.
      dp_axis: an optional replica axis (HSDP): parameters are replicated over
        it, the batch is split over both axes, and gradient shards are averaged
        over it after the reduce-scatter.
      buffers: how many gathered units may exist at once (>= 2).
      prefetch: how many units ahead gathers start; needs `prefetch + 1 <= buffers`.
      reshard_after_forward: drop gathered weights after the forward (re-gather
        in backward); False keeps every unit's gathered weights for backward.
      remat: how backward gets each block's activations (`Parallel.remat`): None
        (default) recomputes the block's forward on the re-gathered weights;
        False keeps the forward's activations and rebuilds only the residuals
        of the weights alone from the re-gathered weights (PyTorch FSDP's
        default: no second forward, more activation memory); True recomputes.
      compute_dtype: dtype parameters are gathered (each shard cast before the
        all-gather) and computed in, e.g. bfloat16; the stored parameters and
        the optimizer keep the model's dtype.
      reduce_dtype: dtype gradients are reduce-scattered in (default: their
        own, the compute dtype).
      update_in_backward: update each unit as soon as its gradients are
        reduce-scattered. Excludes `max_grad_norm` and `skip_nonfinite` (both
        need every gradient before any update); the optimizer must be per-leaf
        (adam, adamw, sgd, masks; `prepare` refuses one that combines
        parameters, such as `clip_by_global_norm`).
      max_grad_norm: clip by the global gradient norm.
      skip_nonfinite: skip the update when a gradient is NaN/Inf (default:
        on, unless `update_in_backward`).
      unroll: ignored (kept for compatibility): the engine always unrolls its
        unit loops, since each block runs its own code.
      backend: the `jaxdist.comm` backend.
    """

    mesh: jax.sharding.Mesh
    axis: str = "fsdp"
    dp_axis: str | None = None
    buffers: int = 2
    prefetch: int = 1
    reshard_after_forward: bool = True
    remat: bool | None = None
    compute_dtype: Any = None
    reduce_dtype: Any = None
    update_in_backward: bool = False
    max_grad_norm: float | None = None
    skip_nonfinite: bool | None = None
    unroll: bool = False
    backend: str | None = None

    def __post_init__(self):
        for name in (self.axis, self.dp_axis):
            if name is not None and name not in self.mesh.axis_names:
                raise ValueError(f"FSDP: axis {name!r} is not a mesh axis; the mesh has {self.mesh.axis_names}")
        if self.dp_axis == self.axis:
            raise ValueError(f"FSDP: dp_axis={self.dp_axis!r} is axis itself; the replica axis (HSDP) is another one")
        self.parallel()  # checks the options now, before anything is prepared

    def parallel(self) -> Parallel:
        """The unit engine's options this FSDP is: ZeRO-3 storage over `axis`, replicas over `dp_axis`."""
        shape = self.mesh.shape
        others = [a for a in self.mesh.axis_names if a not in (self.axis, self.dp_axis)]
        wide = [a for a in others if shape[a] > 1]
        if wide:
            raise ValueError(
                f"FSDP: mesh axis {wide[0]!r} (size {shape[wide[0]]}) is neither axis={self.axis!r} nor dp_axis; "
                f"pass dp_axis={wide[0]!r} for HSDP, or use jaxdist.engine.Parallel (e.g. with tensor parallelism)"
            )
        # axes of size 1 (the trainer's dp=1) take the engine's free roles; a role left over gets a name
        # the mesh does not have
        spare = iter([*others, *(f"_unused{i}" for i in range(3))])
        dp_axis = self.dp_axis if self.dp_axis is not None else next(spare)
        return Parallel(
            self.mesh,
            dp_axis=dp_axis,
            fsdp_axis=self.axis,
            tp_axis=next(spare),
            cp_axis=next(spare),
            buffers=self.buffers,
            prefetch=self.prefetch,
            reshard_after_forward=self.reshard_after_forward,
            remat=self.remat,
            compute_dtype=self.compute_dtype,
            reduce_dtype=self.reduce_dtype,
            update_in_backward=self.update_in_backward,
            max_grad_norm=self.max_grad_norm,
            skip_nonfinite=self.skip_nonfinite,
            backend=self.backend,
        )

    def prepare(self, model: nnx.Module, optimizer: optax.GradientTransformation, units: Units, batch) -> ParallelRun:
        """Shard `model`'s parameters over `axis` and build the train step (`Parallel.prepare`).

        Args:
          model: a Flax NNX model; `units` says how it splits (each block runs its own code).
          optimizer: any optax transformation (it sees the model's parameter tree); per-leaf
            with `update_in_backward`.
          units: how the model splits into units (`jaxdist.engine.Units`).
          batch: an example global batch; its leading dimension is split over the data axes.
        """
        return self.parallel().prepare(model, optimizer, units, batch)
