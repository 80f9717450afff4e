"""The engine's train state in the canonical form (`jaxdist.core.canonical`) and back.

The parameters are already the model's tree, sharded like the canonical form; only grouped column
layers (fused q/k/v) are stored in another order along their tp dimension (`to_storage`), and so
is every optimizer leaf holding their values along it. The model's variables become one pure dict,
as DDP stores them.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxdist.core.canonical import canonical_avals, check_canonical, mirrored_shardings, with_shardings
from jaxdist.core.per_leaf import owners
from jaxdist.core.step import TrainState, on_auto_axes
from jaxdist.engine.layout import Layout, Leaf
from jaxdist.engine.units import ModelSplit
from jaxdist.tp.storage import from_storage, to_storage


class CanonicalForm:
    """Conversions between a run's state (laid out by `layout`) and the canonical form.

    Args:
      layout: the parameters' layout; split: the model's units (its variables' structure).
      optimizer: the optax transformation (its state's structure).
      state_shardings: the run's train state shardings.
      who: the strategy's name, for errors.
    """

    def __init__(self, layout: Layout, split: ModelSplit, optimizer, state_shardings: TrainState, who: str):
        self.layout, self.split, self.optimizer = layout, split, optimizer
        self.state_shardings, self.who = state_shardings, who
        self.cfg = layout.cfg

    def shardings(self) -> TrainState:
        """Where the canonical state lives: parameters and the optimizer state mirroring them sharded as
        stored (over tp and the storage axis), except grouped columns (see `spec`); everything else
        replicated."""
        layout = self.layout
        params = layout.unflatten(
            [
                jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=layout.sharding(self.spec(leaf)))
                for leaf in layout.leaves
            ]
        )
        return mirrored_shardings(self.optimizer, params, self.model_avals(), layout.sharding(P()))

    def spec(self, leaf: Leaf) -> P:
        """The storage spec, but a grouped column (fused q/k/v), stored in another order along its tp
        dimension, is split along another dimension instead: the reorder is then local to each device
        and the resharding an all-to-all (sharded along the tp dimension it would need whole copies)."""
        spec = self.layout.spec(leaf)
        if leaf.groups == 1 or leaf.tp_dim is None:
            return spec
        axes = [a for part in spec if part is not None for a in (part if isinstance(part, tuple) else (part,))]
        n = int(np.prod([self.cfg.size(a) for a in axes]))
        others = [d for d, size in enumerate(leaf.shape) if d != leaf.tp_dim and size % n == 0]
        if not others:
            return spec  # e.g. a fused bias: one dimension, small
        dim = max(others, key=lambda d: (leaf.shape[d], -d))
        return P(*[(tuple(axes) if len(axes) > 1 else axes[0]) if d == dim else None for d in range(len(leaf.shape))])

    def model_avals(self):
        return jax.eval_shape(self.model_state, self.split.initial_model_state)

    def avals(self) -> TrainState:
        params = self.layout.unflatten([jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in self.layout.leaves])
        return canonical_avals(self.optimizer, params, self.model_avals())

    def target(self) -> TrainState:
        """The canonical state's ShapeDtypeStructs with shardings (what a checkpoint restores onto)."""
        return with_shardings(self.avals(), self.shardings())

    @functools.cached_property
    def to_canonical_jit(self):
        # built once: a new jit per call would retrace and recompile at every checkpoint
        return jax.jit(self.to_canonical, out_shardings=self.shardings())

    def from_canonical_checked(self, tree: TrainState) -> TrainState:
        """This run's state from a canonical one (e.g. restored from a checkpoint of another layout)."""
        check_canonical(tree, self.avals(), self.who)
        return jax.jit(self.from_canonical, out_shardings=self.state_shardings)(on_auto_axes(tree))

    def reorder(self, tree, convert):
        """Apply `convert(x, tp_dim, groups, tp)` to every parameter and every optimizer leaf holding a
        parameter's values along its tp dimension (`opt_tp_dims`)."""
        tp, leaves = self.cfg.tp, self.layout.leaves
        params, opt = tree
        xs = jax.tree.leaves(params)
        params = self.layout.unflatten(
            [convert(x, leaf.tp_dim, leaf.groups, tp) for x, leaf in zip(xs, leaves, strict=True)]
        )
        opt_leaves, opt_def = jax.tree.flatten(opt)
        placed = [
            x if k is None else convert(x, dim, leaves[k].groups, tp)
            for x, (k, dim) in zip(opt_leaves, self.opt_tp_dims(opt), strict=True)
        ]
        return params, opt_def.unflatten(placed)

    def opt_tp_dims(self, opt) -> list[tuple[int | None, int | None]]:
        """For each optimizer leaf, `(k, dim)`: it holds parameter k's values along k's reordered tp dimension
        in its dimension `dim` (a mirror such as Adam's moments, or a statistic with one dimension reduced
        away such as Adafactor's row and column moments), else `(None, None)`. Only grouped columns (fused
        q/k/v) are stored in another order; a leaf of one whose order cannot be derived is refused."""
        out = []
        leaves = self.layout.leaves
        paths = jax.tree_util.tree_flatten_with_path(opt)[0]
        by_path = owners(opt, self.layout.unflatten(leaves), same_shape=False)
        for (kp, x), k in zip(paths, by_path, strict=True):
            leaf = None if k is None else leaves[k]
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

    def to_canonical(self, state: TrainState) -> TrainState:
        # into the canonical shardings first: a grouped column's tp dimension is then whole on each device,
        # so its reorder is local (left to XLA, the reorder ran on the stored sharding and was followed by a
        # full rematerialization per leaf, with a warning each)
        target = self.shardings()
        placed = jax.lax.with_sharding_constraint((state.params, state.opt_state), (target.params, target.opt_state))
        params, opt = self.reorder(placed, from_storage)
        return TrainState(params, opt, state.step, self.model_state(state.model_state))

    def from_canonical(self, tree: TrainState) -> TrainState:
        params, opt = self.reorder((tree.params, tree.opt_state), to_storage)
        return TrainState(params, opt, tree.step, self.own_model_state(tree.model_state))

    def model_state(self, model_state) -> dict:
        """The model's variables as one pure dict (as DDP stores them): the blocks' under the blocks' name."""
        out = dict(model_state["outer"])
        blocks = {i: b for i, b in model_state["blocks"].items() if jax.tree.leaves(b)}
        if blocks:
            out[self.split.units.blocks] = blocks
        return out

    def own_model_state(self, canonical: dict) -> dict:
        """The train state's `model_state` from the canonical pure dict."""
        name = self.split.units.blocks
        outer = {k: v for k, v in canonical.items() if k != name}
        placed = canonical.get(name, {})
        blocks = (
            {i: placed.get(i, {}) for i in range(self.split.n_blocks)} if self.split.block_states is not None else {}
        )
        return {"outer": outer, "blocks": blocks}
