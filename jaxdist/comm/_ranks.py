"""How ranks are numbered along a tuple of mesh axes: one rule for every op and both backends.

Along `axis_name=(n0, n1, ..., nk)` a device's rank reads its coordinates on
those axes as one mixed-radix number in *tuple* order, `n0` most significant:
`rank = (...(c0 * s1 + c1) * s2 + ...) * sk + ck`, where `ci` is the device's
index along `ni` and `si` that axis's size. This is `lax.axis_index(axis_name)`,
the order in which `all_gather` concatenates and `reduce_scatter` deals out
slices, the rank `sendrecv`'s pairs name, and the rank of a device in the nccl
backend's communicator for that tuple. So `("b", "a")` and `("a", "b")` number
the same devices differently, whatever the mesh's own axis order.

`lax.ppermute` alone numbers a tuple in mesh order; the xla backend translates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def reorder_rank(rank: int, names: Sequence[str], sizes: Mapping[str, int], to: Sequence[str]) -> int:
    """The rank along `to` of the device whose rank along `names` is `rank` (same axes, another order)."""
    coords = dict(zip(names, np.unravel_index(rank, [sizes[n] for n in names]), strict=True))
    return int(np.ravel_multi_index([coords[n] for n in to], [sizes[n] for n in to]))
