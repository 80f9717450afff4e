"""The canonical train state: one form of a run's state that every layout converts to and from.

A strategy stores parameters and optimizer state in its own layout (an nnx.State,
tp pieces in storage order, ...). The canonical form is what a
single-device optax run holds: parameters as the model's pure dict (keyed by
parameter path, single-device shapes), the optimizer state of
`optimizer.init(params)` on that dict, the step, and the model's other
variables as a pure dict (`jaxdist.core.model_state`). Its arrays stay sharded
(e.g. along the dimension the storage shards), so a checkpoint of it is
written from the devices that hold the shards, and converting between two
layouts is a resharding inside `jit`, never a full copy on one device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxdist.core.per_leaf import owners
from jaxdist.core.step import TrainState


def mirror_map(opt_tree, params, on_mirror: Callable[[Any, Any], Any], on_other: Callable[[Any], Any]):
    """Map the optimizer state: `on_mirror(leaf, param)` on each leaf that mirrors a parameter (the
    same path suffix and shape, as Adam's moments do, also inside masked and multi_transform states),
    `on_other(leaf)` on the rest (counts, schedules' state). `params` may hold ShapeDtypeStructs."""
    leaves, treedef = jax.tree.flatten(opt_tree)
    mirrored = jax.tree.leaves(params)
    placed = [
        on_other(x) if k is None else on_mirror(x, mirrored[k])
        for x, k in zip(leaves, owners(opt_tree, params), strict=True)
    ]
    return treedef.unflatten(placed)


def mirrored_shardings(optimizer: optax.GradientTransformation, params, model_state_avals, replicated) -> TrainState:
    """Where a train state lives whose parameters are `params` (ShapeDtypeStructs with shardings): each
    parameter as given, every optimizer state leaf mirroring a parameter (`mirror_map`) as that parameter,
    the rest of the optimizer state, the step and the model state (`model_state_avals`) on `replicated`."""
    opt = mirror_map(jax.eval_shape(optimizer.init, params), params, lambda _, p: p.sharding, lambda _: replicated)
    model_state = jax.tree.map(lambda _: replicated, model_state_avals)
    return TrainState(jax.tree.map(lambda p: p.sharding, params), opt, replicated, model_state)


def canonical_avals(optimizer: optax.GradientTransformation, params_avals, model_state_avals) -> TrainState:
    """The shapes and dtypes of the canonical state of a run with these parameters."""
    opt = jax.eval_shape(optimizer.init, params_avals)
    return TrainState(params_avals, opt, jax.ShapeDtypeStruct((), jnp.int32), model_state_avals)


def with_shardings(avals, shardings):
    """ShapeDtypeStructs carrying shardings: what orbax restores onto, what `jit` lowers with."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), avals, shardings)


def resharding(fn: Callable, mesh: jax.sharding.Mesh, out_shardings) -> Callable:
    """`jit(fn)` onto `out_shardings`, with XLA free to place the intermediates (Auto axes inside, also on a
    mesh of Explicit axes, where a reshape of a sharded dimension would otherwise need its own sharding)."""
    explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    inner = jax.sharding.auto_axes(fn, out_sharding=out_shardings) if explicit else fn
    return jax.jit(inner, out_shardings=out_shardings)


def check_canonical(tree, expected, who: str) -> None:
    """Raise a one-line error if `tree` is not shaped like the run's canonical state `expected`."""
    got, want = jax.tree.structure(tree), jax.tree.structure(expected)
    if got != want:
        raise ValueError(
            f"{who}.from_canonical: the state's structure differs from this run's (another model or optimizer?): "
            f"got {str(got)[:200]}, expected {str(want)[:200]}"
        )
    for (kp, a), b in zip(jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree.leaves(expected), strict=True):
        if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
            raise ValueError(
                f"{who}.from_canonical: {jax.tree_util.keystr(kp)} is {a.dtype}{list(a.shape)}, this run "
                f"expects {b.dtype}{list(b.shape)}; restore onto the same model and optimizer"
            )
