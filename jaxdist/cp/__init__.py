"""Context parallelism: each data rank's sequences split over a `cp` mesh axis.

`layout` says which tokens each cp rank holds (chunks r and 2 cp - 1 - r of 2 cp, so causal
attention costs every rank the same) and cuts a batch into them; `attention` runs the model's own
`jax.nn.dot_product_attention` calls on keys and values all-gathered over cp, under a mask built
from the global positions of the local queries and of the gathered keys. The unit engine
(`jaxdist.engine.Parallel(cp_axis=...)`) applies both inside its per-device program.
"""

from jaxdist.cp.attention import (
    AttentionProbe,
    attention_over,
    check_model,
    probe_attention,
)
from jaxdist.cp.batch import POSITIONS, check_step_batch, local_batch, local_batch_avals, sequence_dims, sequence_length
from jaxdist.cp.layout import attention_pairs, chunk_len, chunks_of, gathered_indices, local_indices

__all__ = [
    "POSITIONS",
    "AttentionProbe",
    "attention_over",
    "attention_pairs",
    "check_model",
    "check_step_batch",
    "chunk_len",
    "chunks_of",
    "gathered_indices",
    "local_batch",
    "local_batch_avals",
    "local_indices",
    "probe_attention",
    "sequence_dims",
    "sequence_length",
]
