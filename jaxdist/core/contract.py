"""The run contract: what `prepare` of every strategy returns.

`DDP(...).prepare`, `FSDP(...).prepare`, `Parallel(...).prepare` and `Pipelined(...).prepare` each
return a run that satisfies `Run`, so a training loop, the trainer's checkpoints and evaluation
work with any of them unchanged.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from flax import nnx

from jaxdist.core.step import TrainState


@runtime_checkable
class Run(Protocol):
    """A prepared strategy.

    Attributes:
      state: the initial train state: parameters in the strategy's storage layout, the optimizer
        state mirroring them, the step and the model state; ordinary sharded arrays (`jax.Array`).
    """

    state: TrainState

    def step(self, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        """One training step on a global batch: the new state (the old one is donated) and the
        metrics (`loss`, `grad_norm`, `skipped`)."""
        ...

    def params(self, state: TrainState) -> Any:
        """The model's parameters as a pure dict in the model's own order and shapes."""
        ...

    def model(self, state: TrainState) -> nnx.Module:
        """An NNX model holding the state's parameters and model state (train mode)."""
        ...

    def canonical(self, state: TrainState) -> TrainState:
        """The state in the one checkpoint form every layout shares (single-device shapes, sharded)."""
        ...

    def from_canonical(self, tree: TrainState) -> TrainState:
        """The inverse of `canonical`: a canonical tree (from any layout) as this run's state."""
        ...

    def canonical_target(self) -> TrainState:
        """Abstract arrays with the canonical form's shapes and this run's shardings (restore targets)."""
        ...
