"""The unit engine: data parallelism (replicated, ZeRO-1 or ZeRO-3 storage) x tensor parallelism,
over an unmodified Flax NNX model split into units, with communication one unit ahead.

`Parallel` is the strategy, `Units` says how a model splits, `FSDP` is `Parallel` configured for
ZeRO-3 with double buffering. The engine is small parts, bottom-up:

* `options`: `Units` and the options (`Options`, which `Parallel` extends with `prepare`);
* `layout`: every parameter's `Leaf` and where it is stored (`Layout`, which takes a spec rule);
* `units`: the model split into the outer model and blocks, with their variables and the TP plan;
  `apply`: the units' code on parameter pieces, the plan bound, the gradient sums over tp;
* `unit_comm`: a unit's gather and gradient reduction as async ops;
* `step`: the train step around a per-device program (`train_step`), and the engine's own
  program (`UnitGrads`); `canonical`: the state in the checkpoint form and back;
* `run`: `EngineParts` (the parts, built together) and `ParallelRun`, which wires them;
* `prefetch`: the loop with communication `depth` units ahead; `residuals`: which activations a
  block keeps without its gathered weights.
"""

from jaxdist.engine.fsdp import FSDP
from jaxdist.engine.run import Parallel, ParallelRun, Units

__all__ = ["FSDP", "Parallel", "ParallelRun", "Units"]
