"""DDP's train state in the canonical form (`jaxdist.core.canonical`) and back.

DDP's parameters are already the model's tree, sharded as the canonical form is (under ZeRO-1 split
over the axis, else replicated): converting is renaming (an `nnx.State` <-> its pure dict, the
optimizer state re-labelled leaf by leaf); no data moves.
"""

from __future__ import annotations

import functools

import jax

from jaxdist.core.canonical import canonical_avals, check_canonical, resharding, with_shardings
from jaxdist.core.step import TrainState, on_auto_axes


class RenamedCanonical:
    """Conversions between a DDP state and the canonical form.

    Args:
      treedef / pure_treedef: the parameters' tree as stored (an `nnx.State`) and as its pure dict.
      param_avals / stored_avals: the parameters' and the model state's ShapeDtypeStructs.
      optimizer: the optax transformation (its state's structure).
      state_shardings: the run's train state shardings.
      mesh: the mesh the conversions are jitted over.
    """

    def __init__(self, treedef, pure_treedef, param_avals, stored_avals, optimizer, state_shardings, mesh):
        self.treedef, self.pure_treedef = treedef, pure_treedef
        self.param_avals, self.stored_avals = param_avals, stored_avals
        self.optimizer, self.state_shardings, self.mesh = optimizer, state_shardings, mesh

    @functools.cached_property
    def avals(self) -> TrainState:
        return canonical_avals(self.optimizer, self.pure_treedef.unflatten(self.param_avals), self.stored_avals)

    def shardings(self) -> TrainState:
        """Where the canonical state lives: where the run stores it (under zero1 each parameter and its
        optimizer state split over the axis along the first dimension that divides; else replicated)."""
        return self.to_canonical(self.state_shardings)

    def target(self) -> TrainState:
        """The canonical state's ShapeDtypeStructs with shardings (what a checkpoint restores onto)."""
        return with_shardings(self.avals, self.shardings())

    def to_canonical(self, state: TrainState) -> TrainState:
        """The traced renaming (a tree of arrays or of shardings alike)."""
        params = self.pure_treedef.unflatten(jax.tree.leaves(state.params))
        opt = jax.tree.structure(self.avals.opt_state).unflatten(jax.tree.leaves(state.opt_state))
        return TrainState(params, opt, state.step, state.model_state)

    def from_canonical(self, tree: TrainState) -> TrainState:
        params = self.treedef.unflatten(jax.tree.leaves(tree.params))
        opt = jax.tree.structure(self.state_shardings.opt_state).unflatten(jax.tree.leaves(tree.opt_state))
        return TrainState(params, opt, tree.step, tree.model_state)

    @functools.cached_property
    def to_canonical_jit(self):
        # built once: a new jit per call would retrace and recompile at every checkpoint
        return resharding(self.to_canonical, self.mesh, self.shardings())

    def from_canonical_checked(self, tree: TrainState) -> TrainState:
        """`tree` checked against the canonical form of this model and optimizer, then converted."""
        check_canonical(tree, self.avals, "DDP")
        return resharding(self.from_canonical, self.mesh, self.state_shardings)(on_auto_axes(tree))
