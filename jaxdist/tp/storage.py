"""Storage order of tp pieces: each rank's piece of a parameter contiguous along its split dimension."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def to_storage(x, dim: int | None, groups: int, size: int):
    """Reorder `x` along `dim` so that tp rank r's piece is the r-th contiguous chunk (a no-op
    unless `groups > 1`, where rank r holds the r-th part of every group)."""
    return _swap_blocks(x, dim, groups, size)


def from_storage(x, dim: int | None, groups: int, size: int):
    """The inverse of `to_storage`."""
    return _swap_blocks(x, dim, size, groups)


def _swap_blocks(x, dim: int | None, outer: int, inner: int):
    """View dimension `dim` as (outer, inner, rest) and swap the first two."""
    if dim is None or outer == 1 or inner == 1:
        return x
    shape = x.shape
    y = x.reshape(*shape[:dim], outer, inner, shape[dim] // (outer * inner), *shape[dim + 1 :])
    return jnp.swapaxes(y, dim, dim + 1).reshape(shape)


def split(x, dim: int | None, groups: int, rank: int, size: int):
    """Rank `rank`'s piece of the full parameter `x` (for tests and conversions)."""
    if dim is None:
        return x
    x = np.asarray(to_storage(jnp.asarray(x), dim, groups, size))
    n = x.shape[dim] // size
    return np.take(x, np.arange(rank * n, (rank + 1) * n), axis=dim)
