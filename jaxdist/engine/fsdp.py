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

import optax
from flax import nnx

from jaxdist.engine.run import Parallel, ParallelRun, Units

__all__ = ["FSDP", "Units"]

# the options FSDP fixes: ZeRO-3 storage over `axis`, no tensor parallelism
FIXED = ("plan", "fsdp_axis", "tp_axis", "cp_axis", "zero1", "sequence_parallel", "sequence_dim")


class FSDP(Parallel):
    """Fully sharded data parallelism over the mesh axis `axis`: `Parallel` with ZeRO-3 storage over
    `axis`, an optional replica axis and no tensor parallelism.

    `FSDP(mesh, axis="fsdp", dp_axis=None, **options)`; `options` are `Parallel`'s other than those
    FSDP fixes (`plan`, `fsdp_axis`, `tp_axis`, `zero1`, `sequence_parallel`, `sequence_dim`):

    Attributes:
      mesh: the device mesh.
      axis: the mesh axis parameters are sharded over.
      replica_axis: the `dp_axis` argument: an optional replica axis (HSDP): parameters are
        replicated over it, the batch is split over both axes, and gradient shards are averaged
        over it after the reduce-scatter. (`dp_axis`, as `Parallel`'s, names the engine's role:
        this axis, or one the mesh does not have.)
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
      backend: the `jaxdist.comm` backend.
      pack_units: False gathers and reduce-scatters each unit as grouped collectives over its
        pieces, without packing them into flat buffers (`Parallel.pack_units`).

    `unroll` is accepted and ignored (kept for compatibility): the engine always unrolls its unit
    loops, since each block runs its own code.
    """

    def __init__(self, mesh, axis: str = "fsdp", dp_axis: str | None = None, *, unroll: bool = False, **options):
        del unroll
        known = {f.name for f in dataclasses.fields(Parallel)}
        for name in options:
            if name in FIXED:
                raise TypeError(
                    f"FSDP: {name} is fixed by FSDP (ZeRO-3 over axis, no tensor parallelism); use "
                    "jaxdist.engine.Parallel to set it"
                )
            if name not in known or name in ("mesh", "dp_axis"):
                raise TypeError(f"FSDP: unexpected option {name!r}; FSDP takes Parallel's options but {FIXED}")
        for name in (axis, dp_axis):
            if name is not None and name not in mesh.axis_names:
                raise ValueError(f"FSDP: axis {name!r} is not a mesh axis; the mesh has {mesh.axis_names}")
        if dp_axis == axis:
            raise ValueError(f"FSDP: dp_axis={dp_axis!r} is axis itself; the replica axis (HSDP) is another one")
        others = [a for a in mesh.axis_names if a not in (axis, dp_axis)]
        wide = [a for a in others if mesh.shape[a] > 1]
        if wide:
            raise ValueError(
                f"FSDP: mesh axis {wide[0]!r} (size {mesh.shape[wide[0]]}) is neither axis={axis!r} nor dp_axis; "
                f"pass dp_axis={wide[0]!r} for HSDP, or use jaxdist.engine.Parallel (e.g. with tensor parallelism)"
            )
        # axes of size 1 (the trainer's dp=1) take the engine's free roles; a role left over gets a name
        # the mesh does not have
        spare = iter([*others, *(f"_unused{i}" for i in range(3))])
        roles = {"dp_axis": dp_axis if dp_axis is not None else next(spare), "fsdp_axis": axis}
        object.__setattr__(self, "replica_axis", dp_axis)
        super().__init__(mesh, **roles, tp_axis=next(spare), cp_axis=next(spare), **options)

    @property
    def axis(self) -> str:
        """The mesh axis parameters are sharded over."""
        return self.fsdp_axis

    def __repr__(self) -> str:
        shown = [f"mesh={dict(self.mesh.shape)}", f"axis={self.axis!r}", f"dp_axis={self.replica_axis!r}"]
        for f in dataclasses.fields(Parallel):
            if f.name not in (*FIXED, "mesh", "dp_axis") and getattr(self, f.name) != f.default:
                shown.append(f"{f.name}={getattr(self, f.name)!r}")
        return f"FSDP({', '.join(shown)})"

    def parallel(self) -> Parallel:
        """The unit engine's options this FSDP is: ZeRO-3 storage over `axis`, replicas over `dp_axis`."""
        return Parallel(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Parallel)})

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
