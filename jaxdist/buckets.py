"""Gradient bucket layouts: which parameters share a flat buffer, at which offsets.

Pure functions over parameter shapes. Parameters are laid out in the order
backward produces their gradients (reverse forward order), each start aligned,
a bucket closes once it holds `bucket_size` elements, and each bucket's end is
padded so a reduce-scatter over `dp` ranks divides it evenly. The layout is
plain data: print it, test it, and `pack`/`unpack` a pytree with it exactly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

PARAM_ALIGN = 64  # elements; every parameter starts on a multiple of this
BUCKET_ALIGN = 128  # elements; with `dp`, every bucket's size is a multiple of lcm(dp, this)
NCCL_BUSBW_ALIGN = 2**16  # elements; optional extra padding that keeps NCCL at full bus bandwidth
DEFAULT_BUCKET_SIZE = 10_000_000  # elements: 40 MB of float32


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one parameter (leaf `leaf` of the pytree, named `name`) lives in its bucket."""

    leaf: int
    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One flat buffer: its dtype, its parameters, its used and padded element counts."""

    index: int
    dtype: np.dtype
    slots: tuple[Slot, ...]
    used: int  # elements up to the end of the last parameter (alignment gaps included)
    size: int  # padded size, a multiple of lcm(dp, 128)

    @property
    def padding(self) -> int:
        return self.size - self.used


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """Buckets in gradient order (bucket 0 is reduced first), for a pytree with `treedef`."""

    buckets: tuple[Bucket, ...]
    treedef: jax.tree_util.PyTreeDef
    dp: int

    def __len__(self) -> int:
        return len(self.buckets)

    def __str__(self) -> str:
        rows = [("bucket", "dtype", "params", "used", "size", "padding", "first .. last")]
        for b in self.buckets:
            names = f"{b.slots[0].name} .. {b.slots[-1].name}" if len(b.slots) > 1 else b.slots[0].name
            rows.append(
                (str(b.index), b.dtype.name, str(len(b.slots)), str(b.used), str(b.size), str(b.padding), names)
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        total = sum(b.size for b in self.buckets)
        lines.append(f"{len(self.buckets)} buckets, {total} elements, dp={self.dp}")
        return "\n".join(lines)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def bucket_layout(
    params,
    dp: int,
    *,
    bucket_size: int | None = DEFAULT_BUCKET_SIZE,
    bucket_bytes: int | None = None,
    first_bucket_size: int | None = None,
    forward_order: Sequence[int] | None = None,
    shared: Sequence[str] = (),
    pad_for_nccl: bool = False,
) -> BucketLayout:
    """Lay out the leaves of `params` (arrays or ShapeDtypeStructs) in buckets.

    Args:
      params: a pytree of parameters; only shapes and dtypes are read.
      dp: the data-parallel size; every bucket size is a multiple of lcm(dp, 128).
      bucket_size: elements after which a bucket closes (None: one bucket per dtype).
      bucket_bytes: the same in bytes (per dtype); overrides `bucket_size`.
      first_bucket_size: a smaller size for the first bucket, so the first
        reduction starts sooner.
      forward_order: leaf indices in the order the forward pass first uses them
        (default: pytree order). Buckets follow the reverse of this order.
      shared: leaf names (as `jax.tree_util.keystr` of the path, without the
        leading bracket/dot noise, e.g. "embed/embedding") that get a bucket of
        their own, such as a tied embedding whose gradient is finished last.
      pad_for_nccl: pad bucket sizes further, to multiples of 65536 elements.

    Returns:
      A `BucketLayout`; bucket 0 holds the parameters whose gradients come first.
    """
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"bucket_layout: dp must be a positive int, got {dp!r}")
    for name, value in (("bucket_size", bucket_size), ("bucket_bytes", bucket_bytes), ("first", first_bucket_size)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"bucket_layout: {name} must be a positive int or None, got {value!r}")
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    names = [param_name(path) for path, _ in paths_leaves]
    leaves = [leaf for _, leaf in paths_leaves]
    order = list(range(len(leaves))) if forward_order is None else list(forward_order)
    if sorted(order) != list(range(len(leaves))):
        raise ValueError(f"bucket_layout: forward_order must be a permutation of 0..{len(leaves) - 1}, got {order}")
    unknown = set(shared) - set(names)
    if unknown:
        raise ValueError(f"bucket_layout: shared names {sorted(unknown)} are not parameters; names are {names}")

    end_align = math.lcm(dp, BUCKET_ALIGN, NCCL_BUSBW_ALIGN if pad_for_nccl else 1)
    buckets: list[Bucket] = []
    open_slots: dict[np.dtype, list[Slot]] = {}
    open_used: dict[np.dtype, int] = {}

    def close(dtype):
        slots = open_slots.pop(dtype, [])
        used = open_used.pop(dtype, 0)
        if slots:
            buckets.append(Bucket(len(buckets), dtype, tuple(slots), used, _round_up(used, end_align)))

    n_shared = sum(names[leaf] in shared for leaf in order)

    def limit(dtype) -> int | None:
        if first_bucket_size is not None and len(buckets) == n_shared:
            return first_bucket_size
        if bucket_bytes is not None:
            return max(1, bucket_bytes // dtype.itemsize)
        return bucket_size

    # Shared parameters first: in reverse forward order they are what backward finishes last,
    # but giving them their own bucket up front keeps every other bucket's boundaries unchanged.
    for leaf in reversed(order):
        if names[leaf] in shared:
            dtype = np.dtype(leaves[leaf].dtype)
            slot = Slot(leaf, names[leaf], tuple(leaves[leaf].shape), 0)
            buckets.append(Bucket(len(buckets), dtype, (slot,), slot.size, _round_up(slot.size, end_align)))
    for leaf in reversed(order):
        if names[leaf] in shared:
            continue
        dtype = np.dtype(leaves[leaf].dtype)
        offset = _round_up(open_used.get(dtype, 0), PARAM_ALIGN)
        slot = Slot(leaf, names[leaf], tuple(leaves[leaf].shape), offset)
        open_slots.setdefault(dtype, []).append(slot)
        open_used[dtype] = offset + slot.size
        cap = limit(dtype)
        if cap is not None and open_used[dtype] >= cap:
            close(dtype)
    for dtype in list(open_slots):
        close(dtype)
    return BucketLayout(tuple(buckets), treedef, dp)


def param_name(path) -> str:
    """A readable name for a pytree path: keys joined by '/' (e.g. 'blocks/0/attn/kernel').

    A trailing `.value` (how Flax NNX variables hold their array) is left out.
    """
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    if len(parts) > 1 and isinstance(path[-1], jax.tree_util.GetAttrKey) and parts[-1] == "value":
        parts.pop()
    return "/".join(parts)


def pack_bucket(bucket: Bucket, leaves: Sequence, dtype=None) -> jax.Array:
    """The flat buffer of `bucket` from the pytree's `leaves` (gaps and padding are zeros)."""
    dtype = bucket.dtype if dtype is None else dtype
    pieces, end = [], 0
    for slot in bucket.slots:
        if slot.offset > end:
            pieces.append(jnp.zeros((slot.offset - end,), dtype))
        pieces.append(jnp.ravel(leaves[slot.leaf]).astype(dtype))
        end = slot.offset + slot.size
    if bucket.size > end:
        pieces.append(jnp.zeros((bucket.size - end,), dtype))
    return jnp.concatenate(pieces)


def unpack_bucket(bucket: Bucket, flat: jax.Array, dtype=None) -> dict[int, jax.Array]:
    """The parameters in `flat` (one bucket's buffer), by leaf index."""
    if flat.shape != (bucket.size,):
        raise ValueError(f"unpack_bucket: bucket {bucket.index} has {bucket.size} elements, got shape {flat.shape}")
    dtype = bucket.dtype if dtype is None else dtype
    return {s.leaf: flat[s.offset : s.offset + s.size].reshape(s.shape).astype(dtype) for s in bucket.slots}


def pack(layout: BucketLayout, tree, dtype=None) -> list[jax.Array]:
    """Every bucket's flat buffer from a pytree shaped like the layout's."""
    leaves = layout.treedef.flatten_up_to(tree)
    return [pack_bucket(b, leaves, dtype) for b in layout.buckets]


def unpack(layout: BucketLayout, flats: Sequence[jax.Array], dtypes=None):
    """The pytree from every bucket's flat buffer (the inverse of `pack`).

    `dtypes`, if given, is a pytree of dtypes (or a single dtype) for the leaves.
    """
    if len(flats) != len(layout.buckets):
        raise ValueError(f"unpack: the layout has {len(layout.buckets)} buckets, got {len(flats)} buffers")
    leaves: dict[int, jax.Array] = {}
    for bucket, flat in zip(layout.buckets, flats, strict=True):
        leaves.update(unpack_bucket(bucket, flat))
    ordered = [leaves[i] for i in range(layout.treedef.num_leaves)]
    if dtypes is not None:
        leaf_dtypes = (
            layout.treedef.flatten_up_to(dtypes) if not isinstance(dtypes, np.dtype | type) else [dtypes] * len(ordered)
        )
        ordered = [x.astype(d) for x, d in zip(ordered, leaf_dtypes, strict=True)]
    return layout.treedef.unflatten(ordered)
