"""What every strategy's train step shares: the train state, the batch check, the placed
jit, and the optimizer side of a step in global view (norm, clip, update, skip)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from jaxdist.compat import on_mesh
from jaxdist.core.model_state import keep_if


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """What a step updates: parameters (in the strategy's storage layout), optimizer state, step, and
    the model's other variables (RNG streams, batch statistics; `jaxdist.core.model_state`), replicated."""

    params: Any
    opt_state: Any
    step: jax.Array
    model_state: Any = dataclasses.field(default_factory=dict)


def own_mesh(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """The strategy's copy of `mesh`: the same devices and names with Auto axes, so that outside the
    per-device program XLA places the optimizer math, propagating the parameters' shardings whatever
    axis types the user's mesh has."""
    auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


def on_auto_axes(tree):
    """`tree` with every array sharded over a mesh of Explicit axes retyped onto the same devices and
    spec with Auto axes (no data moves): a model built inside a user's `jax.set_mesh` holds such
    arrays, and the strategy's programs, on its own mesh of Auto axes, refuse operands typed by
    another mesh's axes."""

    def retype(x):
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
            return x
        sharding = x.sharding
        if isinstance(sharding, NamedSharding) and jax.sharding.AxisType.Explicit in sharding.mesh.axis_types:
            return jax.device_put(x, NamedSharding(own_mesh(sharding.mesh), sharding.spec))
        return x

    return jax.tree.map(retype, tree)


def on_own_mesh(method: Callable) -> Callable:
    """`method` of a prepared run, run with the run's own mesh (`self.mesh`) as JAX's context mesh:
    inside a user's `jax.set_mesh` (of this mesh with Explicit axes, or of another mesh) it computes
    what it computes outside one."""

    @functools.wraps(method)
    def on_the_run_mesh(self, *args, **kwargs):
        with on_mesh(self.mesh):
            return method(self, *args, **kwargs)

    return on_the_run_mesh


def local_batch_avals(batch, ranks: int, who: str, fix: str):
    """The per-rank shapes of `batch` split `ranks` ways along its leading dimension, which every leaf
    must have, of one size: leaves of different sizes would each be split evenly and broadcast
    against each other per rank, training silently on mismatched rows."""
    sizes = {}
    for path, x in jax.tree_util.tree_leaves_with_path(batch):
        name = jax.tree_util.keystr(path, simple=True, separator="/") or "the batch"
        if jnp.ndim(x) == 0:
            raise ValueError(
                f"{who}: batch leaf {name!r} is a scalar; every leaf's leading dimension is the batch "
                "(pass a per-batch constant to the model or the loss function instead)"
            )
        sizes.setdefault(x.shape[0], name)
    if len(sizes) > 1:
        said = ", ".join(f"{name!r} has {size}" for size, name in sizes.items())
        raise ValueError(
            f"{who}: the batch's leaves disagree on the batch size (their leading dimension): {said}; "
            "give every leaf the same number of rows"
        )

    def local(x):
        if x.shape[0] % ranks:
            raise ValueError(f"{who}: batch leading dimension {x.shape[0]} must be divisible by {fix}")
        return jax.ShapeDtypeStruct((x.shape[0] // ranks, *x.shape[1:]), x.dtype)

    return jax.tree.map(local, batch)


class PlacedStep:
    """`jit(step, donate state)` whose batch is first put on the strategy's own batch sharding.

    A strategy that computes on its own copy of the mesh (e.g. with Auto axes, so XLA places the
    optimizer math) must not mix shardings of two mesh objects in one program (jax >= 0.11 refuses
    it): a batch sharded over the caller's mesh is moved onto the strategy's first, outside jit, and
    the step is traced and run with the strategy's mesh as the context mesh (a caller's
    `jax.set_mesh` does not reach it). `lower` does the same, for reading the compiled program.
    `check(batch)`, when given, runs first: a batch of another shape than `prepare`'s example is fine
    where it splits as the strategy needs, and a clear error (naming the fix) where it does not.
    """

    def __init__(self, step: Callable, batch_sharding: NamedSharding, check: Callable[[Any], Any] | None = None):
        self.jitted = jax.jit(step, donate_argnums=0)
        self.batch_sharding = batch_sharding
        self.check = check
        self.mesh = batch_sharding.mesh
        self.compiled = None  # `compile`'s executable, run while the arguments are those it was made for

    def _place(self, batch):
        if self.check is not None:
            self.check(batch)
        return jax.tree.map(lambda x: jax.device_put(x, self.batch_sharding), batch)

    @on_own_mesh
    def __call__(self, state, batch):
        placed = self._place(batch)
        if self.compiled is not None:
            try:
                return self.compiled(state, placed)
            except (TypeError, ValueError):  # other shapes or shardings than it was compiled for (checked first)
                self.compiled = None
        return self.jitted(state, placed)

    @on_own_mesh
    def lower(self, state, batch):
        return self.jitted.lower(state, self._place(batch))

    @on_own_mesh
    def compile(self, state, batch) -> jax.stages.Compiled:
        """Compile the step for `state` and batches shaped like `batch` now (e.g. to read its
        `memory_analysis()` before running it); the steps then run this executable, not a second compile."""
        if self.check is not None:
            self.check(batch)
        avals = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.batch_sharding), batch)
        self.compiled = self.jitted.lower(state, avals).compile()
        return self.compiled


def optimizer_step(
    optimizer: optax.GradientTransformation,
    params,
    opt_state,
    grads,
    *,
    max_grad_norm: float | None = None,
    skip_nonfinite: bool = True,
    loss: jax.Array | None = None,
) -> tuple[Any, Any, jax.Array, jax.Array]:
    """The optimizer side of a step on the parameter tree, in global view (outside shard_map, on
    sharded arrays): XLA adds the reductions a global norm needs, so any optax transformation
    (masks, multi_transform, clip_by_global_norm) is exactly what it is on one device.

    Args:
      optimizer: the optax transformation.
      params, opt_state: the current parameters and optimizer state.
      grads: the reduced gradients, shaped like `params`, in the reduction's dtype: the norm is
        taken in float32 (float64 for float64 gradients), the clip (`optax.clip_by_global_norm`'s
        arithmetic) in the wider of that dtype and the parameter's, then each gradient is cast to
        its parameter's dtype.
      max_grad_norm: clip the gradients to this global L2 norm (None: no clip).
      skip_nonfinite: keep parameters and optimizer state when the norm (or `loss`) is NaN/Inf.
      loss: the step's loss, if given: a NaN/Inf loss skips the step too (a loss made NaN where its
        gradient is not, by a `jnp.where`, would otherwise train on).

    Returns:
      `(params, opt_state, grad_norm, skipped)`.
    """
    leaves = jax.tree.leaves(grads)
    # at least float32 (bfloat16 squares would overflow and round), float64 for float64 gradients (a float32
    # norm would clip them at float32 precision)
    dtype = jnp.result_type(jnp.float32, *(g.dtype for g in leaves))
    norm = jnp.sqrt(sum((jnp.sum(jnp.square(g.astype(dtype))) for g in leaves), jnp.zeros((), dtype)))
    clip = None if max_grad_norm is None else norm >= max_grad_norm

    def to_param_dtype(g, p):  # clipped in the wider of the two dtypes: a bfloat16 reduction is not rounded twice
        if clip is not None:  # optax.clip_by_global_norm's arithmetic: no epsilon, exact at any scale
            wide = jnp.promote_types(g.dtype, p.dtype)
            g = g.astype(wide)
            g = jnp.where(clip, g / norm.astype(wide) * np.asarray(max_grad_norm, wide), g)
        return g.astype(p.dtype)

    grads = jax.tree.map(to_param_dtype, grads, params)
    updates, new_opt = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    skipped = jnp.zeros((), jnp.bool_)
    if skip_nonfinite:
        skipped = ~jnp.isfinite(norm)  # a NaN/Inf anywhere makes the global norm non-finite
        if loss is not None:
            skipped = skipped | ~jnp.isfinite(loss)
        new_params, new_opt = keep_if(skipped, (new_params, new_opt), (params, opt_state))
    return new_params, new_opt, norm, skipped
