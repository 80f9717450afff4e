"""The unit engine: data parallelism (replicated, ZeRO-1 or ZeRO-3 storage) x tensor parallelism,
over an unmodified Flax NNX model split into units, with communication one unit ahead.

`Parallel` is the strategy, `Units` says how a model splits, `FSDP` is `Parallel` configured for
ZeRO-3 with double buffering; `prefetch` is the loop with communication `depth` units ahead and
`residuals` which activations a block keeps without its gathered weights.
"""

from jaxdist.engine.fsdp import FSDP
from jaxdist.engine.run import Parallel, ParallelRun, Units

__all__ = ["FSDP", "Parallel", "ParallelRun", "Units"]
