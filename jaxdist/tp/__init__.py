"""Tensor parallelism: plans as data (`plan`, its `placement`s), bound onto a model's own layers
(`bind`, with the pieces in `storage` order), the vocabulary-parallel loss (`vocab_loss`), the
Megatron layer math inside `shard_map` (`layers`), and which replicated parameters' gradients sum
over tp (`grads`).

A plan names a model's layers and how each splits (`TPPlan({"blocks/*/attn/qkv": column(), ...})`);
the engine binds it to the model. The layer functions are for code that writes its own
`shard_map`.
"""

from jaxdist.tp.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbed,
    column_linear,
    copy_to_tp,
    gather_sequence,
    gather_whole,
    reduce_from_tp,
    row_linear,
    scatter_sequence,
    split_sequence,
    vocab_parallel_cross_entropy,
    vocab_parallel_embed,
)
from jaxdist.tp.plan import Placement, TPPlan, VocabShardedLogits, column, cross_entropy, replicated, row, vocab

__all__ = [
    "TPPlan",
    "Placement",
    "column",
    "row",
    "vocab",
    "replicated",
    "cross_entropy",
    "VocabShardedLogits",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbed",
    "column_linear",
    "row_linear",
    "copy_to_tp",
    "reduce_from_tp",
    "gather_whole",
    "gather_sequence",
    "scatter_sequence",
    "split_sequence",
    "vocab_parallel_embed",
    "vocab_parallel_cross_entropy",
]
