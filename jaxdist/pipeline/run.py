"""Pipeline parallelism over a `pp` mesh axis: the unit engine's blocks split into stages, run by
a schedule table (`jaxdist.pipeline.schedule`), composed with the engine's data and tp axes.

The repeated blocks split into `pp * v` stages of equal length; rank r of `pp`
runs stages r, r + pp, ... (its chunks), the embedding runs with stage 0 and
the head and loss with the last stage. Each data rank's batch splits into
micro-batches. The step runs the schedule's ticks in order, inside the
engine's `shard_map`: at a tick every rank runs its table entry (a `lax.switch`
on its pp rank; the ops: `stage_ops`), then the tick's activations and gradients move between
neighbouring stages in one `comm.sendrecv` (with the nccl backend: one NCCL
group, also for a warm-up tick's lone send and a cool-down tick's lone
receive), on one token chain that orders the ticks.

Memory: what a stage keeps between its ops lives in slots the table assigns,
each freed by the last op that reads it (`stage_step.tick_plan`): the inputs
it received and, by default, its forward's residuals (so the backward runs no
second forward; `remat=True` keeps only the input and recomputes), and under
ZB-H1 what W needs from B. So the live activations of 1F1B and ZB-H1 are
bounded by pp, not by the micro-batch count. The last stage's F also runs the
head, its loss and gradient, and keeps the output gradient its B starts from.

Parameters are the model's tree, stored as the engine stores them (over the
data axes and split over tp), and every block parameter is also split over pp:
each rank stores 1/pp of every block (and of its optimizer state). A step
brings a stage's pieces to the stage's rank (an all-to-all over pp, as pp - 1
ring-shifted sendrecvs) and its gradients back to the pieces. The embedding
and head are replicated over pp; their gradients are summed over pp.

A rank's stage gradients are averaged over the data axes in the tick of its
last op (one all-reduce per dtype, inside the tick loop), so the last stage's
reduction runs while the earlier stages still run the cool-down; each rank
then keeps its storage share. Everything else is the engine's
(`jaxdist.engine.run.EngineParts`, built with the pipeline's layout rule
`placement.pp_spec`): the block code runs with the plan's parallel layers
bound, and the optimizer, global norm, clipping and skip run on the parameter
tree outside the per-device program (`jaxdist.engine.step.train_step`, given
the schedule's program `stage_step.ScheduleGrads`).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from flax import nnx

from jaxdist.engine.run import EngineParts, Parallel, PartsRun, Units
from jaxdist.pipeline import schedule as ps
from jaxdist.pipeline.placement import StagePlacement, pp_spec
from jaxdist.pipeline.stage_ops import stage_variants
from jaxdist.pipeline.stage_step import ScheduleGrads, micro_avals, tick_plan


@dataclasses.dataclass(frozen=True)
class Pipelined(Parallel):
    """`Parallel`'s options plus a pipeline axis.

    Attributes:
      pp_axis: the mesh axis the stages are spread over (size >= 2).
      microbatches: micro-batches per data rank's batch (its rows must divide).
      schedule: "1f1b", "gpipe", "interleaved" or "zb-h1" (alias "zbh1"; `jaxdist.pipeline.schedule`).
      virtual: stages per rank (chunks) of the interleaved schedule.

    `remat`: None (default) or False keeps each stage's forward residuals until its backward (W
    under ZB-H1) reads them: no second forward, and 1F1B bounds them by pp micro-batches; True
    keeps only the stage's input and recomputes the forward in the backward (less memory, one more
    forward). With an fsdp axis a step gathers this rank's pieces once and keeps them
    (`reshard_after_forward`, `buffers` and `prefetch` do not apply).

    `per_rank_programs`: where each process holds the devices of one pp rank (a multi-process run,
    e.g. one process per GPU with pp = the process count), each process traces its own rank's
    column of the table (`stage_step._Ticks.run_rank`): no switch on the rank; the column's repeating
    part is one loop of known trip count and the ticks around it straight-line code, so the device runs
    the ticks back to back without the host choosing each one. Off
    by default: checked on CPU processes (gloo) against the one-program step, not yet measured on
    GPUs. A process holding devices of several pp ranks is refused with this option.
    """

    pp_axis: str = "pp"
    microbatches: int = 4
    schedule: str = "1f1b"
    virtual: int = 1
    per_rank_programs: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.pp < 2:
            raise ValueError(f"Pipelined: the mesh needs a {self.pp_axis!r} axis of size >= 2; use Parallel without")
        for flag in ("record_weights", "sequence_parallel", "update_in_backward"):
            if getattr(self, flag):
                raise ValueError(f"Pipelined: {flag} is not supported with a pipeline axis yet; turn it off")
        self.table()  # a table that cannot run is an error now, before anything is traced

    def axis_roles(self) -> dict[str, str]:
        return {**super().axis_roles(), "pp_axis": self.pp_axis}

    @property
    def keeps_activations(self) -> bool:
        """Whether a stage keeps its forward's residuals for backward (else recomputes them: remat=True)."""
        return self.remat is not True

    @property
    def pp(self) -> int:
        """The pipeline-parallel size."""
        return self.size(self.pp_axis)

    def local_batch(self, batch):
        """`Parallel.local_batch`, and a data rank's rows must split into the micro-batches."""
        local = super().local_batch(batch)
        micro_avals(self, local)
        return local

    def table(self) -> ps.Schedule:
        """The validated schedule table the step runs."""
        return ps.make(self.schedule, self.pp, self.microbatches, self.virtual)

    def prepare(self, model, optimizer, units: Units, batch) -> PipelineRun:
        """Shard `model`'s parameters and build the pipelined train step (as `Parallel.prepare`)."""
        return PipelineRun(self, model, optimizer, units, batch)


class PipelineRun(PartsRun):
    """A prepared pipelined run: `state`, `step`, `params`, `model` and the canonical form as
    `ParallelRun`'s; `table` is the schedule it runs (print it), `plan` its arrays, `parts` its
    `EngineParts`."""

    def __init__(self, cfg: Pipelined, model, optimizer, units: Units, batch):
        for flag in ("stacked", "has_aux", "sum_and_count"):
            if getattr(units, flag):
                raise ValueError(f"Pipelined: Units({flag}=True) is not supported with a pipeline axis yet")
        self.cfg, self.optimizer, self.units = cfg, optimizer, units
        self.table = cfg.table()
        spec_rule = functools.partial(pp_spec, cfg, units.blocks)
        self.parts = parts = EngineParts.build(cfg, model, optimizer, units, batch, spec_rule=spec_rule)
        self.mesh, self.state, self.state_shardings = parts.mesh, parts.state, parts.state_shardings
        split, leaves, block_leaves = parts.split, parts.layout.leaves, parts.code.block_leaves
        stages = cfg.pp * cfg.virtual
        if split.n_blocks % stages:
            raise ValueError(
                f"Pipelined: {split.n_blocks} blocks do not split into pp * virtual = {stages} stages of equal "
                "length; change pp, virtual or the number of blocks"
            )
        per_stage = split.n_blocks // stages
        self.placement = StagePlacement(cfg, leaves, block_leaves, units.blocks, per_stage)

        def shapes(i):
            return [(leaves[k].shape, leaves[k].dtype, leaves[k].local, leaves[k].tp_dim) for k in block_leaves[i]]

        for i in range(split.n_blocks):
            if not (split.block_trees[i] == split.block_trees[0] and shapes(i) == shapes(0)):
                raise ValueError(
                    f"Pipelined: block {i}'s parameters differ from block 0's (names or shapes); the stages "
                    "exchange weights of one layout, so every block must hold the same parameters"
                )
        # blocks may differ in code or static attributes (a Gemma's local and global layers): each stage
        # runs the code of its variant
        self.stage_variants, variant_starts = stage_variants(split.block_kinds, per_stage, stages)
        self.plan = tick_plan(self.table, keep=cfg.keeps_activations, variants=self.stage_variants)
        if not split.outer_state.empty or any(not ms.empty for ms in split.block_states):
            held = [
                f"{'/'.join(map(str, path))} ({type(v).__name__ if isinstance(v, nnx.Variable) else 'an array'})"
                for path, v in split.rest.flat_state()
            ]
            raise ValueError(
                f"Pipelined: the model holds non-parameter variables ({', '.join(held[:3])}"
                f"{f' and {len(held) - 3} more' if len(held) > 3 else ''}), which a pipeline axis does not support "
                "yet: dropout RNG streams, batch statistics, and constants (a RoPE table, a frozen weight as an "
                "nnx.Variable); compute a table in the call, keep a frozen weight as an nnx.Param frozen by the "
                "optimizer (optax.set_to_zero), or train without the pp axis"
            )
        rank = process_pp_rank(self.mesh, cfg.pp_axis) if cfg.per_rank_programs else None
        grads = ScheduleGrads(
            cfg,
            parts,
            self.table,
            self.plan,
            self.placement,
            keep=cfg.keeps_activations,
            variant_starts=variant_starts,
            rank=rank,
        )
        self._step, self.step = parts.placed_step(grads)


def process_pp_rank(mesh, pp_axis: str) -> int:
    """The pp rank of this process's devices in `mesh`; a process holding devices of several pp ranks (or
    none) raises, naming them: its devices would need the programs of several ranks."""
    axis = mesh.axis_names.index(pp_axis)
    local = {d.id for d in mesh.local_devices}
    ranks = sorted({int(i[axis]) for i, d in np.ndenumerate(mesh.devices) if d.id in local})
    if len(ranks) != 1:
        raise ValueError(
            f"Pipelined(per_rank_programs=True): this process holds devices of pp ranks {ranks}; each process "
            f"must hold the devices of one pp rank (as many processes as the {pp_axis!r} axis has ranks, e.g. "
            "one process per GPU), or turn per_rank_programs off"
        )
    return ranks[0]
