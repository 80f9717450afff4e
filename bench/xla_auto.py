"""XLA's own automatic sharding of a train step: the baseline jaxdist is compared against.

A plain `jit` of value_and_grad + optax, with sharding annotations only: the
batch split over the data axes, and parameters (and so optimizer state)
either replicated ("dp") or split along their largest divisible dimension over
an axis ("fsdp"). XLA's SPMD partitioner inserts every collective itself.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.core.step import PlacedStep, TrainState


def _param_spec(shape, axis: str | None, size: int) -> P:
    if axis is None:
        return P()
    dims = sorted(range(len(shape)), key=lambda d: -shape[d])
    for d in dims:
        if shape[d] % size == 0:
            return P(*([None] * d), axis)
    return P()


class AutoShardedRun:
    """`state` and `step(state, batch) -> (state, metrics)` for XLA's automatic DP or FSDP."""

    def __init__(
        self,
        mesh: jax.sharding.Mesh,
        model: nnx.Module,
        optimizer: optax.GradientTransformation,
        loss_fn: Callable,
        *,
        batch_axes: tuple[str, ...],
        shard_axis: str | None,
    ):
        # Auto axes: classic GSPMD propagation, where XLA decides every intermediate sharding
        mesh = jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        self.optimizer, self.loss_fn = optimizer, loss_fn
        size = mesh.shape[shard_axis] if shard_axis else 1
        shardings = jax.tree.map(lambda x: NamedSharding(mesh, _param_spec(x.shape, shard_axis, size)), params)
        params = jax.device_put(params, shardings)
        opt_state = jax.jit(optimizer.init)(params)  # zeros_like keeps each parameter's sharding
        self.batch_sharding = NamedSharding(mesh, P(batch_axes))
        step = jax.device_put(jax.numpy.zeros((), "int32"), NamedSharding(mesh, P()))
        self.state = TrainState(params, opt_state, step)
        self.step = PlacedStep(self._step, self.batch_sharding)  # the batch moves onto the Auto mesh first

    def _step(self, state: TrainState, batch):
        # a sharding constraint: with Auto axes, device_put inside jit would not split the batch
        batch = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, self.batch_sharding), batch)
        loss, grads = jax.value_and_grad(lambda p: self.loss_fn(nnx.merge(self.graphdef, p, self.rest), batch))(
            state.params
        )
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(params, opt_state, state.step + 1), {"loss": loss, "grad_norm": optax.global_norm(grads)}
