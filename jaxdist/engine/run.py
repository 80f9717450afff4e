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

This module wires the parts: `options` (what to do), `units` and `apply` (the model as units and
their code), `layout` (where each parameter lives), `unit_comm` (a unit's gather and reduction),
`step` (the train step) and `canonical` (the checkpoint form). `EngineParts.build` makes them;
a strategy with its own schedule (`jaxdist.pipeline`) builds them with its own layout rule and
passes its own per-device program to `jaxdist.engine.step.train_step`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxdist import cp
from jaxdist.compat import on_mesh
from jaxdist.core.model_state import training_copy
from jaxdist.core.per_leaf import check_per_leaf, owners
from jaxdist.core.step import PlacedStep, TrainState, on_auto_axes, on_own_mesh, own_mesh
from jaxdist.engine.apply import UnitCode, block_leaf_groups
from jaxdist.engine.canonical import CanonicalForm
from jaxdist.engine.layout import Layout, Leaf
from jaxdist.engine.options import Options, Units
from jaxdist.engine.step import UnitGrads, train_step
from jaxdist.engine.unit_comm import UnitComm
from jaxdist.engine.units import ModelSplit

__all__ = ["EngineParts", "Parallel", "ParallelRun", "PartsRun", "Units"]


@dataclasses.dataclass(frozen=True)
class Parallel(Options):
    """DP x FSDP x TP x CP training over the mesh axes that exist: the options (every attribute is
    documented at `jaxdist.engine.options.Options`) and `prepare`, which applies them to a model."""

    def prepare(self, model: nnx.Module, optimizer: optax.GradientTransformation, units: Units, batch):
        """Shard `model`'s parameters and build the train step.

        Args:
          model: a Flax NNX model; `units` says how it splits.
          optimizer: any optax transformation; it sees the model's parameter tree.
          units: the model's embed / blocks / head split.
          batch: an example global batch (a pytree); its leading dimension is split over the data axes.
        """
        return ParallelRun(self, model, optimizer, units, batch)


@dataclasses.dataclass(eq=False)
class EngineParts:
    """The parts of a prepared engine run, built by `EngineParts.build`.

    Attributes:
      cfg, mesh, optimizer: the options, the mesh the run computes on (`own_mesh`), the optax
        transformation.
      split: the model as units (`jaxdist.engine.units.ModelSplit`).
      layout: where each parameter lives (`jaxdist.engine.layout.Layout`).
      code: the units' code on parameter pieces (`jaxdist.engine.apply.UnitCode`).
      comm: the units' gather and reduce ops (`jaxdist.engine.unit_comm.UnitComm`).
      state, state_shardings: the initial train state and its shardings.
      opt_owners: per optimizer state leaf, the parameter leaf it mirrors (or None).
      canonical: the conversions to and from the checkpoint form (`jaxdist.engine.canonical`).
    """

    cfg: Options
    mesh: jax.sharding.Mesh
    optimizer: optax.GradientTransformation
    split: ModelSplit
    layout: Layout
    code: UnitCode
    comm: UnitComm
    state: TrainState
    state_shardings: TrainState
    opt_owners: list
    canonical: CanonicalForm

    @classmethod
    def build(
        cls,
        cfg: Options,
        model: nnx.Module,
        optimizer,
        units: Units,
        batch,
        *,
        spec_rule: Callable[[Leaf], P] | None = None,
    ) -> EngineParts:
        """Split `model` as `units` says, resolve the plan, lay out and store its parameters.

        Args:
          cfg, model, optimizer, units, batch: as `Parallel.prepare`'s.
          spec_rule: where a leaf is stored (`jaxdist.engine.layout.Layout`); default the engine's
            `storage_spec` (tp and the storage axis).
        """
        mesh = own_mesh(cfg.mesh)
        with on_mesh(mesh):  # inside a user's jax.set_mesh too
            model = training_copy(model)  # the step runs train mode; the caller's model is untouched
            nnx.update(model, on_auto_axes(nnx.state(model)))  # a model built inside a user's jax.set_mesh
            split = ModelSplit(model, units, type(cfg).__name__)
            if cfg.sequence_parallel or cfg.cp > 1:
                _refuse_batch_statistics(split, cfg.cp > 1)
            placements = split.resolve_plan(cfg, model, batch) if cfg.plan is not None and cfg.tp > 1 else None
            stacked = units.blocks if units.stacked else None
            layout = Layout(cfg, mesh, split.pure, placements, stacked, spec_rule)
            block_leaves = block_leaf_groups(split, layout)
            local_batch = cfg.local_batch(batch)
            code = UnitCode(cfg, mesh, split, layout, placements, block_leaves, local_batch)
            if cfg.update_in_backward:
                check_per_leaf(optimizer, split.pure, "Parallel", _one_layer(split.pure, stacked))
            state, state_shardings = layout.init_state(split.pure, optimizer, split.initial_model_state)
            canonical = CanonicalForm(layout, split, optimizer, state_shardings, "Parallel")
            return cls(
                cfg=cfg,
                mesh=mesh,
                optimizer=optimizer,
                split=split,
                layout=layout,
                code=code,
                comm=UnitComm(cfg, layout),
                state=state,
                state_shardings=state_shardings,
                opt_owners=owners(state.opt_state, state.params),
                canonical=canonical,
            )

    def placed_step(self, local_grads: Callable, aux_specs=None) -> tuple[Callable, PlacedStep]:
        """The train step around the per-device program `local_grads` (`jaxdist.engine.step.train_step`),
        and that step jitted with the batch placed and checked (`PlacedStep`). Under cp the program sees its
        rank's chunks of the sequence and the model's attention the whole context (`per_cp_rank`)."""
        check = self.cfg.local_batch
        if self.cfg.cp > 1:
            local_grads = per_cp_rank(self.cfg, self.code.cp_length, local_grads)
            check = self._check_cp_batch
        step = train_step(self.cfg, self.layout, self.optimizer, self.state_shardings, local_grads, aux_specs)
        return step, PlacedStep(step, self.layout.sharding(self.cfg.batch_spec), check=check)

    def _check_cp_batch(self, batch) -> None:
        self.cfg.local_batch(batch)
        cp.check_step_batch(batch, self.code.cp_batch_dims, self.code.cp_length, type(self.cfg).__name__)

    @functools.cached_property
    def replicated(self) -> Callable:
        """`(params, model_state) -> (full parameter list, model_state)`, replicated."""

        # one program that every process runs: a `device_put` per leaf starts a small cross-process program
        # each, and independent programs may run concurrently (CPU, gloo), their collectives then met in
        # another order by each process: a hang
        def full(params, model_state):
            return self.layout.full(params), model_state

        return jax.jit(full, out_shardings=self.layout.sharding(P()))

    def as_params(self, full: list) -> nnx.State:
        """The full parameters (one array per leaf) as the model's `nnx.State`."""
        out = jax.tree.map(lambda x: x, self.split.template)
        nnx.replace_by_pure_dict(out, self.layout.unflatten(full))
        return out

    def params(self, state: TrainState) -> nnx.State:
        return self.as_params(self.replicated(state.params, None)[0])

    def model(self, state: TrainState) -> nnx.Module:
        full, model_state = self.replicated(state.params, state.model_state)
        return nnx.merge(self.split.graphdef, self.as_params(full), self.split.rest_of(model_state))


def _one_layer(pure: dict, stacked: str | None) -> dict | None:
    """The parameters with the stacked layers' leaves as one layer's (what update_in_backward updates at a
    time), None without stacked layers."""
    if stacked is None:
        return None
    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), pure[stacked])
    return {**pure, stacked: one}


def per_cp_rank(cfg: Options, length: int, local_grads: Callable) -> Callable:
    """`local_grads` on this device's cp rank: its chunks of the sequence (`jaxdist.cp.local_batch`), with
    the model's `jax.nn.dot_product_attention` over the whole context (`jaxdist.cp.attention_over`)."""

    def on_rank(params, model_state, step, batch, *opt_state):
        rank = jax.lax.axis_index(cfg.cp_axis)
        batch = cp.local_batch(batch, rank, cfg.cp, length, cfg.cp_whole)
        with cp.attention_over(cfg.cp_axis, cfg.cp, length, cfg.backend, type(cfg).__name__):
            return local_grads(params, model_state, step, batch, *opt_state)

    return on_rank


class PartsRun:
    """The run contract (`jaxdist.core.contract.Run`) over `self.parts`, an `EngineParts`: what every run
    built from the engine's parts offers besides its `state` and `step` (`ParallelRun`, and the
    pipeline's `PipelineRun`)."""

    parts: EngineParts

    @property
    def n_blocks(self) -> int:
        return self.parts.split.n_blocks

    @on_own_mesh
    def params(self, state: TrainState) -> nnx.State:
        """The full parameters of `state` as the single-device model holds them (an `nnx.State`), replicated."""
        return self.parts.params(state)

    @on_own_mesh
    def model(self, state: TrainState) -> nnx.Module:
        """An NNX model holding the parameters of `state`."""
        return self.parts.model(state)

    @on_own_mesh
    def canonical_shardings(self) -> TrainState:
        """Where the canonical state lives (`jaxdist.engine.canonical.CanonicalForm.shardings`)."""
        return self.parts.canonical.shardings()

    @on_own_mesh
    def canonical_target(self) -> TrainState:
        """The canonical state's ShapeDtypeStructs with shardings (what a checkpoint restores onto)."""
        return self.parts.canonical.target()

    @on_own_mesh
    def canonical(self, state: TrainState) -> TrainState:
        """`state` in the canonical form (single-device shapes and order), resharded inside jit."""
        return self.parts.canonical.to_canonical_jit(state)

    @on_own_mesh
    def from_canonical(self, tree: TrainState) -> TrainState:
        """This run's state from a canonical one (e.g. restored from a checkpoint of another layout)."""
        return self.parts.canonical.from_canonical_checked(tree)

    def _from_canonical(self, tree: TrainState) -> TrainState:
        """`from_canonical`'s traced conversion (no checks, not jitted): for reading its compiled program."""
        return self.parts.canonical.from_canonical(tree)


class ParallelRun(PartsRun):
    """A prepared run: `state`, `step(state, batch) -> (state, metrics)`, `params(state)`, `model(state)`,
    and the canonical (checkpoint) form; `parts` are its `EngineParts`."""

    def __init__(self, cfg: Options, model: nnx.Module, optimizer, units: Units, batch):
        self.cfg, self.optimizer, self.units = cfg, optimizer, units
        self.parts = parts = EngineParts.build(cfg, model, optimizer, units, batch)
        self.mesh, self.state, self.state_shardings = parts.mesh, parts.state, parts.state_shardings
        grads = UnitGrads(cfg, parts.code, parts.comm, optimizer, parts.opt_owners)
        self._step, self.step = parts.placed_step(grads, parts.code.aux_specs)

    @property
    def leaves(self) -> list[Leaf]:
        """Every parameter's leaf (`jaxdist.engine.layout.Leaf`), in the model's tree order."""
        return self.parts.layout.leaves

    @property
    def tied(self) -> list[int]:
        """The leaves both the embed and the head read (a tied embedding)."""
        return self.parts.code.tied

    @property
    def sequence_dim(self) -> int:
        """The activations' dimension sequence parallelism splits over tp."""
        return self.parts.code.sequence_dim


def _refuse_batch_statistics(split: ModelSplit, cp: bool) -> None:
    """Under sequence parallelism each tp rank runs a block on its chunk of the tokens, under context
    parallelism each cp rank runs the whole model on its chunks of every sequence: a BatchNorm there would
    normalize by the chunk's statistics, not the data rank's (silently other numbers than one device's),
    so such a model is refused."""
    states = [("block " + str(i), s) for i, s in enumerate(split.block_states or ())]
    if cp:
        states.append(("the model outside its blocks", split.outer_state))
    for where, state in states:
        if any(state.is_batch_stat):
            how = (
                "under cp each cp rank would take them over its chunks of the sequences"
                if cp
                else "under sequence_parallel each tp rank would take them over its chunk of the tokens"
            )
            fix = "leave cp out" if cp else "turn sequence_parallel off"
            raise ValueError(
                f"Parallel: {where} holds batch statistics (nnx.BatchStat, e.g. BatchNorm); {how}, not over the "
                f"whole batch; {fix}, or normalize per token (LayerNorm, RMSNorm)"
            )
