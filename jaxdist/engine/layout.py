"""Where every parameter lives: one `Leaf` per parameter (its full shape, its split over tp and
over the storage axis) and the `Layout` of them all on the mesh (specs, shardings, avals, the
conversions into and out of the stored order, the initial train state).

Each parameter is stored as one `jax.Array` of the model's own shape, sharded over `tp` as the
plan places it and over the storage axis on the largest dimension of its tp piece that divides.
A strategy with more axes (the pipeline's `pp`) passes its own `spec_rule`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.core.canonical import mirror_map
from jaxdist.core.step import TrainState
from jaxdist.engine.options import Options
from jaxdist.tp.plan import ResolvedPlan
from jaxdist.tp.storage import from_storage, to_storage


@dataclasses.dataclass(frozen=True)
class Leaf:
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


def storage_spec(cfg: Options, leaf: Leaf) -> P:
    """The engine's placement of `leaf`: its tp dimension over tp, its storage dimension over the
    storage axis (inside tp where both fall on one dimension)."""
    dims: list = [None] * len(leaf.shape)
    if leaf.tp_dim is not None:
        dims[leaf.tp_dim] = cfg.tp_axis
    if leaf.store_dim is not None:
        axis = cfg.storage_axis
        dims[leaf.store_dim] = axis if dims[leaf.store_dim] is None else (cfg.tp_axis, axis)
    return P(*dims)


def make_leaf(cfg: Options, path: tuple, x, placements: ResolvedPlan | None, stacked: bool) -> Leaf:
    """The leaf of parameter `x` at `path`; `stacked`: `x` has a leading layer axis, never split."""
    skip = 1 if stacked else 0  # tp and storage dims count past the layer axis
    dim, groups = (None, 1)
    if placements is not None:
        dim, groups = placements.param_split(path, x.ndim - skip)
        dim = None if dim is None else dim + skip
    local = tuple(s // cfg.tp if d == dim else s for d, s in enumerate(x.shape))
    store = None
    n_store = cfg.size(cfg.storage_axis) if cfg.storage_axis else 0
    if n_store:  # the largest dimension of the tp piece that divides evenly
        fits = [d for d in range(skip, len(local)) if local[d] % n_store == 0]
        store = max(fits, key=lambda d: (local[d], -d)) if fits else None
    return Leaf(path, tuple(x.shape), x.dtype, dim, groups, local, store)


def whole_shape(leaf: Leaf) -> tuple:
    return leaf.shape


def piece_shape(leaf: Leaf) -> tuple:
    return leaf.local


class Layout:
    """The parameters' leaves in the model's tree order, and where they are stored on `mesh`.

    Args:
      cfg: the engine's options (the tp and storage axes).
      mesh: the mesh the run computes on.
      pure: the model's parameters as a pure dict.
      placements: the resolved TP plan, or None without tp.
      stacked: the name of a stacked blocks module (its leaves keep their layer axis unsplit), or None.
      spec_rule: `spec_rule(leaf) -> PartitionSpec`, where a leaf is stored (default
        `storage_spec(cfg, leaf)`); a strategy adding a mesh axis places the leaves over it here.
    """

    def __init__(
        self,
        cfg: Options,
        mesh: jax.sharding.Mesh,
        pure: dict,
        placements: ResolvedPlan | None,
        stacked: str | None = None,
        spec_rule: Callable[[Leaf], P] | None = None,
    ):
        self.cfg, self.mesh = cfg, mesh
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(pure)
        paths = [tuple(getattr(k, "key", getattr(k, "idx", k)) for k in kp) for kp, _ in flat]
        self.leaves = [
            make_leaf(cfg, path, x, placements, stacked is not None and path[0] == stacked)
            for path, (_, x) in zip(paths, flat, strict=True)
        ]
        self.spec_rule = spec_rule if spec_rule is not None else functools.partial(storage_spec, cfg)

    def spec(self, leaf: Leaf) -> P:
        return self.spec_rule(leaf)

    def specs(self):
        """The parameter tree of specs."""
        return self.treedef.unflatten([self.spec(leaf) for leaf in self.leaves])

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def unflatten(self, xs: list):
        """The parameter tree of `xs`, one per leaf in order."""
        return self.treedef.unflatten(xs)

    def avals(self, indices, whole: bool = False) -> dict:
        """`{k: aval}` of leaves `indices`: one rank's tp pieces, or with `whole` the full parameters."""
        shape = whole_shape if whole else piece_shape
        return {k: jax.ShapeDtypeStruct(shape(self.leaves[k]), self.leaves[k].dtype) for k in indices}

    def store_dim(self, k: int, piece) -> int | None:
        """The storage dim of leaf `k` in `piece` (one layer of a stacked leaf has one axis fewer)."""
        leaf = self.leaves[k]
        return None if leaf.store_dim is None else leaf.store_dim - (len(leaf.shape) - piece.ndim)

    def stored(self, pure):
        """The parameters of the model's pure dict `pure` in the stored order (grouped columns reordered)."""
        xs = jax.tree.leaves(pure)
        tp = self.cfg.tp
        return self.unflatten(
            [to_storage(x, leaf.tp_dim, leaf.groups, tp) for x, leaf in zip(xs, self.leaves, strict=True)]
        )

    def full(self, params) -> list:
        """The stored parameters `params` back in the model's order, one array per leaf."""
        xs = jax.tree.leaves(params)
        tp = self.cfg.tp
        return [from_storage(x, leaf.tp_dim, leaf.groups, tp) for x, leaf in zip(xs, self.leaves, strict=True)]

    def init_state(self, pure, optimizer, model_state) -> tuple[TrainState, TrainState]:
        """The initial train state of parameters `pure` (stored as laid out, the optimizer state mirroring
        them, everything else replicated) and its shardings."""
        shardings = jax.tree.map(self.sharding, self.specs(), is_leaf=lambda s: isinstance(s, P))
        params = jax.jit(self.stored, out_shardings=shardings)(pure)
        replicated = self.sharding(P())
        opt_shapes = jax.eval_shape(optimizer.init, params)
        opt_shardings = mirror_map(opt_shapes, params, lambda _, p: p.sharding, lambda _: replicated)
        opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), self.sharding(P()))
        model_state = jax.device_put(model_state, self.sharding(P()))
        state_shardings = TrainState(
            shardings, jax.tree.map(lambda x: x.sharding, opt_state), step.sharding, self.sharding(P())
        )
        return TrainState(params, opt_state, step, model_state), state_shardings
