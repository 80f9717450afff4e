"""What every strategy's train step shares: the train state, the batch check, the shard_map wrapper."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """What a step updates: parameters (in the strategy's storage layout), optimizer state, step, and
    the model's other variables (RNG streams, batch statistics; `jaxdist.model_state`), replicated."""

    params: Any
    opt_state: Any
    step: jax.Array
    model_state: Any = dataclasses.field(default_factory=dict)


def local_batch_avals(batch, ranks: int, who: str, fix: str):
    """The per-rank shapes of `batch` split `ranks` ways along its leading dimension."""

    def local(x):
        if x.ndim == 0 or x.shape[0] % ranks:
            raise ValueError(
                f"{who}: batch leading dimension {x.shape[0] if x.ndim else None} must be divisible by {fix}"
            )
        return jax.ShapeDtypeStruct((x.shape[0] // ranks, *x.shape[1:]), x.dtype)

    return jax.tree.map(local, batch)


def sharded_step(
    local_step: Callable,
    mesh: jax.sharding.Mesh,
    state: TrainState,
    batch,
    *,
    param_specs,
    opt_specs,
    batch_spec: P,
    metrics: Sequence[str],
) -> tuple[TrainState, dict]:
    """Run `local_step(params, opt_state, model_state, step, batch) -> (params, opt_state, model_state,
    metrics)` under shard_map (the batch placed along `batch_spec`; model state, step and metrics
    replicated) and count the step."""
    batch = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, batch_spec)), batch)
    body = jax.shard_map(
        local_step,
        mesh=mesh,
        in_specs=(param_specs, opt_specs, P(), P(), batch_spec),
        out_specs=(param_specs, opt_specs, P(), {name: P() for name in metrics}),
        check_vma=False,
    )
    params, opt_state, model_state, out = body(state.params, state.opt_state, state.model_state, state.step, batch)
    return TrainState(params, opt_state, state.step + 1, model_state), out


class PlacedStep:
    """`jit(step, donate state)` whose batch is first put on the strategy's own batch sharding.

    A strategy that computes on its own copy of the mesh (e.g. with Auto axes, so XLA places the
    optimizer math) must not mix shardings of two mesh objects in one program (jax >= 0.11 refuses
    it): a batch sharded over the caller's mesh is moved onto the strategy's first, outside jit.
    `lower` does the same, for reading the compiled program.
    """

    def __init__(self, step: Callable, batch_sharding: NamedSharding):
        self.jitted = jax.jit(step, donate_argnums=0)
        self.batch_sharding = batch_sharding

    def _place(self, batch):
        return jax.tree.map(lambda x: jax.device_put(x, self.batch_sharding), batch)

    def __call__(self, state, batch):
        return self.jitted(state, self._place(batch))

    def lower(self, state, batch):
        return self.jitted.lower(state, self._place(batch))
