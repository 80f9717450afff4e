"""Models in plain Flax NNX, each with its tensor-parallel plan and units beside it.

Nothing in a model knows about parallelism; the strategies wrap it from outside. The families
(`FAMILIES`): the GPT, Llama-style decoders (Llama 3, Qwen 2 / 3, Mistral) and Gemma-style ones
(Gemma 3), each with named flavors from CPU demos to released shapes.
"""

from jaxdist.models.families import FAMILIES, Family, family_of
from jaxdist.models.gemma import Gemma, GemmaConfig
from jaxdist.models.gpt import FLAVORS, GPT, GPTConfig
from jaxdist.models.llama import Llama, LlamaConfig

__all__ = [
    "GPT",
    "GPTConfig",
    "FLAVORS",
    "Llama",
    "LlamaConfig",
    "Gemma",
    "GemmaConfig",
    "FAMILIES",
    "Family",
    "family_of",
]
