"""Models in plain Flax NNX, each with its tensor-parallel plan and units beside it.

Nothing in a model knows about parallelism; the strategies wrap it from outside.
"""

from jaxdist.models.gpt import FLAVORS, GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "FLAVORS"]
