"""Which tokens each context-parallel rank holds: the sequence cut into `2 cp` chunks, rank r
holding chunks r and 2 cp - 1 - r (causal load balancing), as plain data.

Under a causal mask the work of a query grows with its position, so equal contiguous pieces would
give the last rank about 2 cp - 1 times the attention of the first; pairing chunk r with its mirror
2 cp - 1 - r gives every rank the same number of unmasked (query, key) pairs (`attention_pairs`).
Everything here is NumPy except `split_sequence`, which takes a rank traced inside `shard_map`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def chunk_len(cp: int, length: int) -> int:
    """The length of one of the `2 cp` chunks of a sequence of `length` tokens (refused unless it divides)."""
    if length % (2 * cp):
        raise ValueError(
            f"context parallelism over cp={cp} cuts each sequence into 2 x cp = {2 * cp} equal chunks, but the "
            f"sequence has {length} tokens; use a sequence length divisible by {2 * cp} or another cp"
        )
    return length // (2 * cp)


def chunks_of(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks rank `rank` of `cp` holds, in the order it holds them."""
    return rank, 2 * cp - 1 - rank


def local_indices(rank: int, cp: int, length: int) -> np.ndarray:
    """The global token indices rank `rank` holds, in its local order (its first chunk, then its second)."""
    n = chunk_len(cp, length)
    return np.concatenate([np.arange(c * n, (c + 1) * n) for c in chunks_of(rank, cp)])


def gathered_indices(cp: int, length: int) -> np.ndarray:
    """The global token index at each position of a tensor all-gathered (tiled) over cp along the sequence:
    every rank's local tokens, in rank order."""
    return np.concatenate([local_indices(r, cp, length) for r in range(cp)])


def traced_local_indices(rank, cp: int, length: int) -> jax.Array:
    """`local_indices` for a rank that is a traced value (`lax.axis_index`)."""
    n = chunk_len(cp, length)
    first = rank * n + jnp.arange(n)
    second = (2 * cp - 1 - rank) * n + jnp.arange(n)
    return jnp.concatenate([first, second]).astype(jnp.int32)


def split_sequence(x: jax.Array, rank, cp: int, dim: int = 1) -> jax.Array:
    """Rank `rank`'s two chunks of `x` along `dim`, concatenated (a traced rank: two dynamic slices)."""
    n = chunk_len(cp, x.shape[dim])
    first = jax.lax.dynamic_slice_in_dim(x, rank * n, n, axis=dim)
    second = jax.lax.dynamic_slice_in_dim(x, (2 * cp - 1 - rank) * n, n, axis=dim)
    return jnp.concatenate([first, second], axis=dim)


def attention_pairs(cp: int, length: int, window: int | None = None, balanced: bool = True) -> np.ndarray:
    """Per rank, the (query, key) pairs a causal mask (and a left window of `window` keys, if given)
    leaves unmasked for its queries: its attention FLOPs, up to a constant. `balanced=False` counts
    the contiguous split (rank r holding tokens r T / cp ... (r + 1) T / cp - 1) for comparison."""
    per_query = np.arange(length) + 1  # keys 0 .. q
    if window is not None:
        per_query = np.minimum(per_query, window + 1)
    if balanced:
        return np.array([per_query[local_indices(r, cp, length)].sum() for r in range(cp)])
    return per_query.reshape(cp, -1).sum(axis=1)
