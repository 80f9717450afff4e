"""Gradient bucket layouts: which parameters share a flat buffer, at which offsets.

Pure functions over parameter shapes. Parameters are laid out in the order
backward produces their gradients (reverse forward order), each start aligned,
a bucket closes once it holds `bucket_size` elements, and each bucket's end is
padded so a reduce-scatter over `dp` ranks divides it evenly. The layout is
plain data: print it, test it, and `pack`/`unpack` a pytree with it exactly.

A rank-major layout (ZeRO-1, `rank_major=True`) splits each parameter into
`dp` chunks along one dimension (`shard_dim`) and puts chunk r of every
parameter of a bucket in segment r of its buffer: a reduce-scatter of the
buffer leaves rank r exactly its chunk of each parameter, and its all-gather
rebuilds the parameters from the chunks, both unpacked locally (`pack_shard`,
`unpack_shard`). Parameters with no dimension `dp` divides get buckets of
their own, laid out whole.
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


def shard_dim(shape: Sequence[int], ranks: int) -> int | None:
    """The dimension a parameter of `shape` is split along over `ranks` ranks: the first that
    `ranks` divides, so a chunk is contiguous in memory wherever the leading dimension divides
    (packing a bucket and unpacking its gather are then reshapes, not transposes); None if none
    does (a scalar, an odd-sized bias) or it holds nothing (a size-0 dimension: no chunk to gather)."""
    if 0 in shape:
        return None
    return next((d for d, s in enumerate(shape) if s % ranks == 0), None)


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one parameter (leaf `leaf` of the pytree, named `name`) lives in its bucket: at
    `offset` of each rank segment, split along `dim` (None: whole, in a one-segment bucket)."""

    leaf: int
    name: str
    shape: tuple[int, ...]
    offset: int
    dim: int | None = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One flat buffer: its dtype, its parameters, its used and padded element counts, and its
    segments: 1 (parameters one after another) or dp (rank-major: segment r holds chunk r of each)."""

    index: int
    dtype: np.dtype
    slots: tuple[Slot, ...]
    used: int  # elements up to the end of the last parameter in each segment (gaps included), times ranks
    size: int  # padded size, a multiple of lcm(dp, 128)
    ranks: int = 1

    @property
    def padding(self) -> int:
        return self.size - self.used

    @property
    def segment(self) -> int:
        """Elements per rank segment (the whole buffer when `ranks` is 1)."""
        return self.size // self.ranks

    @property
    def sharded(self) -> bool:
        """Rank-major (its parameters split along a dimension, even over one rank): reduce-scattered
        and all-gathered; otherwise all-reduced."""
        return self.slots[0].dim is not None

    def chunk(self, slot: Slot) -> int:
        """Elements of `slot` in each segment."""
        return slot.size // self.ranks


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """Buckets in gradient order (bucket 0 is reduced first), for a pytree with `treedef`."""

    buckets: tuple[Bucket, ...]
    treedef: jax.tree_util.PyTreeDef
    dp: int

    def __len__(self) -> int:
        return len(self.buckets)

    def __str__(self) -> str:
        rows = [("bucket", "dtype", "params", "used", "size", "padding", "segments", "first .. last")]
        for b in self.buckets:
            names = f"{b.slots[0].name} .. {b.slots[-1].name}" if len(b.slots) > 1 else b.slots[0].name
            cells = (b.index, b.dtype.name, len(b.slots), b.used, b.size, b.padding, b.ranks, names)
            rows.append(tuple(map(str, cells)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        total = sum(b.size for b in self.buckets)
        lines.append(f"{len(self.buckets)} buckets, {total} elements, dp={self.dp}")
        return "\n".join(lines)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _chunk_align(ranks: int) -> int:
    """Where a parameter's chunk may start in a segment: PARAM_ALIGN over the next power of two of
    `ranks` (at least 1), so the padding per parameter over all segments stays about PARAM_ALIGN."""
    return max(1, PARAM_ALIGN >> (ranks - 1).bit_length())


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
    rank_major: bool = False,
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
      rank_major: lay out each leaf split into `dp` chunks along `shard_dim` in
        `dp` rank segments (ZeRO-1); leaves no dimension of which `dp` divides
        go whole into buckets of their own (one segment).

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
    dims = [shard_dim(leaf.shape, dp) if rank_major else None for leaf in leaves]
    # a kind of bucket: (dtype, sharded); kinds never share a bucket

    def kind_of(leaf):
        return np.dtype(leaves[leaf].dtype), dims[leaf] is not None

    def segments(kind):
        return dp if kind[1] else 1

    buckets: list[Bucket] = []
    open_slots: dict[tuple, list[Slot]] = {}
    open_used: dict[tuple, int] = {}  # per segment

    def close(kind):
        slots = open_slots.pop(kind, [])
        used = open_used.pop(kind, 0)
        if slots:
            dtype, ranks = kind[0], segments(kind)
            size = ranks * _round_up(used, end_align // ranks)
            buckets.append(Bucket(len(buckets), dtype, tuple(slots), ranks * used, size, ranks))

    n_shared = sum(names[leaf] in shared for leaf in order)

    def limit(dtype) -> int | None:
        if first_bucket_size is not None and len(buckets) == n_shared:
            return first_bucket_size
        if bucket_bytes is not None:
            return max(1, bucket_bytes // dtype.itemsize)
        return bucket_size

    def add(leaf):
        kind = kind_of(leaf)
        ranks = segments(kind)
        offset = _round_up(open_used.get(kind, 0), _chunk_align(ranks))
        slot = Slot(leaf, names[leaf], tuple(leaves[leaf].shape), offset, dims[leaf])
        open_slots.setdefault(kind, []).append(slot)
        open_used[kind] = offset + slot.size // ranks
        return kind

    # Shared parameters first: in reverse forward order they are what backward finishes last,
    # but giving them their own bucket up front keeps every other bucket's boundaries unchanged.
    for leaf in reversed(order):
        if names[leaf] in shared:
            close(add(leaf))
    for leaf in reversed(order):
        if names[leaf] in shared:
            continue
        kind = add(leaf)
        cap = limit(kind[0])
        if cap is not None and open_used[kind] * segments(kind) >= cap:
            close(kind)
    for kind in list(open_slots):
        close(kind)
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


def _rows(x: jax.Array, slot: Slot, bucket: Bucket, rows: int) -> jax.Array:
    """`x` (the whole parameter with rows=ranks, or one rank's chunk with rows=1) as `rows` rows:
    row r is chunk r along the slot's dim (a bucket of one segment keeps the parameter's own order)."""
    if slot.dim is None or bucket.ranks == 1:
        return jnp.reshape(x, (rows, -1))
    return jnp.moveaxis(x, slot.dim, 0).reshape(rows, -1)


def _from_rows(rows: jax.Array, slot: Slot, bucket: Bucket) -> jax.Array:
    """The inverse of `_rows`: the parameter (all rows) or one rank's chunk (one row)."""
    if slot.dim is None or bucket.ranks == 1:
        return rows.reshape(slot.shape)
    d = slot.dim
    moved = (slot.shape[d] * rows.shape[0] // bucket.ranks, *slot.shape[:d], *slot.shape[d + 1 :])
    return jnp.moveaxis(rows.reshape(moved), 0, d)


def _pack(bucket: Bucket, leaves, dtype, rows: int) -> jax.Array:
    """`rows` segments of `bucket` (gaps and padding zeros): all of them from whole parameters, or one
    (rows=1) from this rank's chunks."""
    dtype = bucket.dtype if dtype is None else dtype
    pieces, end = [], 0
    for slot in bucket.slots:
        if slot.offset > end:
            pieces.append(jnp.zeros((rows, slot.offset - end), dtype))
        pieces.append(_rows(leaves[slot.leaf], slot, bucket, rows).astype(dtype))
        end = slot.offset + bucket.chunk(slot)
    if bucket.segment > end:
        pieces.append(jnp.zeros((rows, bucket.segment - end), dtype))
    return jnp.concatenate(pieces, axis=1).reshape(-1)


def _unpack(bucket: Bucket, flat: jax.Array, dtype, rows: int) -> dict[int, jax.Array]:
    dtype = bucket.dtype if dtype is None else dtype
    out = {}
    for s in bucket.slots:
        if s.offset == 0 and bucket.chunk(s) == bucket.segment:  # the slot is the whole segment:
            out[s.leaf] = _from_rows(flat.reshape(rows, -1), s, bucket).astype(dtype)  # a view, no copy
            continue
        # contiguous slices, stacked: XLA's CPU backend runs a strided slice of the (rows, segment)
        # view of a gathered buffer far slower (a tiny GPT's ZeRO-1 step: 380 ms vs 250 ms)
        starts = [r * bucket.segment + s.offset for r in range(rows)]
        piece = jnp.stack([flat[a : a + bucket.chunk(s)] for a in starts])
        out[s.leaf] = _from_rows(piece, s, bucket).astype(dtype)
    return out


def pack_bucket(bucket: Bucket, leaves: Sequence, dtype=None) -> jax.Array:
    """The flat buffer of `bucket` from the pytree's `leaves` (gaps and padding are zeros)."""
    return _pack(bucket, leaves, dtype, bucket.ranks)


def unpack_bucket(bucket: Bucket, flat: jax.Array, dtype=None) -> dict[int, jax.Array]:
    """The parameters in `flat` (one bucket's buffer), by leaf index."""
    if flat.shape != (bucket.size,):
        raise ValueError(f"unpack_bucket: bucket {bucket.index} has {bucket.size} elements, got shape {flat.shape}")
    return _unpack(bucket, flat, dtype, bucket.ranks)


def pack_shard(bucket: Bucket, chunks: Sequence, dtype=None) -> jax.Array:
    """One rank's segment of `bucket` from its chunks of the parameters (`chunks[leaf]`, each the
    parameter's slice along its slot's `dim`): what an all-gather of the buffer starts from."""
    return _pack(bucket, chunks, dtype, 1)


def unpack_shard(bucket: Bucket, segment: jax.Array, dtype=None) -> dict[int, jax.Array]:
    """One rank's chunks of the parameters, by leaf index, from its segment of `bucket` (what a
    reduce-scatter of the buffer leaves it); a one-segment bucket's segment is the whole buffer."""
    if segment.shape != (bucket.segment,):
        raise ValueError(
            f"unpack_shard: bucket {bucket.index} has {bucket.segment} elements per rank, got shape {segment.shape}"
        )
    return _unpack(bucket, segment, dtype, 1)


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
