"""A sequence cut into consecutive runs of bounded total size: the files of a model export
(`jaxdist.models.hf`), the transfers of a packed host copy (`jaxdist.train.host_copy`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def consecutive_runs(items: Sequence[T], sizes: Sequence[int], limit: int) -> list[list[T]]:
    """`items` in order, cut into consecutive runs whose `sizes` add up to at most `limit` each (an item
    larger than `limit` is a run of its own); no items: one empty run."""
    runs: list[list[T]] = [[]]
    size = 0
    for item, n in zip(items, sizes, strict=True):
        if runs[-1] and size + n > limit:
            runs.append([])
            size = 0
        runs[-1].append(item)
        size += n
    return runs
