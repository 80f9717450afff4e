"""Bucket layouts: goldens in the spirit of Megatron's test_bucket_sizes, and pack/unpack.

The expected sizes below are worked out by hand (each comment shows the sum):
parameters start on multiples of 64 elements, a bucket closes once it holds
`bucket_size` elements, and its end is padded to a multiple of lcm(dp=8, 128) = 128.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist.ddp.buckets import bucket_layout, pack, pack_bucket, pack_shard, unpack, unpack_shard

N_LAYERS, DIM = 10, 95


def linear_stack(bias: bool, dtype=jnp.float32):
    """10 layers of 95x95 (+ bias), and their forward order: each layer's kernel, then its bias."""
    params = {f"layer_{i}": {"kernel": jax.ShapeDtypeStruct((DIM, DIM), dtype)} for i in range(N_LAYERS)}
    if bias:
        for i in range(N_LAYERS):
            params[f"layer_{i}"]["bias"] = jax.ShapeDtypeStruct((DIM,), dtype)
    # pytree order is layer_0/bias, layer_0/kernel, ... (dict keys sorted); forward uses kernel first
    per_layer = 2 if bias else 1
    order = [i * per_layer + j for i in range(N_LAYERS) for j in ([1, 0] if bias else [0])]
    return params, order


# (bias, bucket_size) -> [(used, padded size)] per bucket
GOLDEN = {
    # no bias: kernels of 9025 elements, the next starts at 9088 (9025 rounded up to 64)
    (False, None): [(9 * 9088 + 9025, 90880)],  # 90817 -> 710 * 128
    (False, 9000): [(9025, 9088)] * 10,  # every kernel alone reaches 9000
    (False, 9025): [(9025, 9088)] * 10,  # 9025 >= 9025 closes
    (False, 18000): [(9088 + 9025, 18176)] * 5,  # 18113 -> 142 * 128
    (False, 20000): [(2 * 9088 + 9025, 27264)] * 3 + [(9025, 9088)],  # 27201 -> 213 * 128
    # with bias, in gradient order: bias (95) at 0, kernel at 128, ends at 9153; the next layer starts at 9216
    (True, None): [(9 * 9216 + 9153, 92160)],  # 92097 -> 720 * 128
    (True, 9000): [(9153, 9216)] * 10,
    (True, 9025): [(9153, 9216)] * 10,
    (True, 18000): [(9216 + 128 + 9025, 18432)] * 5,  # bias at 9216, kernel at 9344: 18369 -> 144 * 128
    (True, 20000): [(18432 + 128 + 9025, 27648)] * 3 + [(9153, 9216)],  # 27585 -> 216 * 128
}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("bucket_size", [None, 9000, 9025, 18000, 20000])
def test_bucket_sizes_match_hand_computed_goldens(bias, bucket_size):
    params, order = linear_stack(bias)
    layout = bucket_layout(params, 8, bucket_size=bucket_size, forward_order=order)
    assert [(b.used, b.size) for b in layout.buckets] == GOLDEN[(bias, bucket_size)]
    for b in layout.buckets:
        assert b.size % 128 == 0
        assert all(s.offset % 64 == 0 for s in b.slots)
        assert b.padding == b.size - b.used
    # gradient order: the last layer's parameters come first, the bias before its kernel
    first = layout.buckets[0].slots
    assert first[0].name == ("layer_9/bias" if bias else "layer_9/kernel")
    assert layout.buckets[-1].slots[-1].name == "layer_0/kernel"
    per_bucket = [len(b.slots) for b in layout.buckets]
    assert sum(per_bucket) == N_LAYERS * (2 if bias else 1)


@pytest.mark.parametrize("bucket_size", [None, 20000])
def test_a_shared_parameter_gets_its_own_first_bucket(bucket_size):
    params, order = linear_stack(bias=False)
    layout = bucket_layout(params, 8, bucket_size=bucket_size, forward_order=order, shared=("layer_0/kernel",))
    assert [s.name for s in layout.buckets[0].slots] == ["layer_0/kernel"]
    assert (layout.buckets[0].used, layout.buckets[0].size) == (9025, 9088)
    rest = [(b.used, b.size) for b in layout.buckets[1:]]
    if bucket_size is None:  # the other 9 kernels: 8 * 9088 + 9025 = 81729 -> 639 * 128
        assert rest == [(81729, 81792)]
    else:  # layers 9..1 in threes: 27201 each
        assert rest == [(27201, 27264)] * 3


def test_first_bucket_can_be_smaller():
    params, order = linear_stack(bias=False)
    layout = bucket_layout(params, 8, bucket_size=20000, first_bucket_size=9000, forward_order=order)
    # layer 9 alone, then threes (8..6, 5..3), then 2..0
    assert [(b.used, b.size) for b in layout.buckets] == [(9025, 9088)] + [(27201, 27264)] * 3


def test_bucket_bytes_and_dp_padding():
    params, order = linear_stack(bias=False)
    by_bytes = bucket_layout(params, 8, bucket_bytes=4 * 18000, forward_order=order)
    by_elems = bucket_layout(params, 8, bucket_size=18000, forward_order=order)
    assert [(b.used, b.size) for b in by_bytes.buckets] == [(b.used, b.size) for b in by_elems.buckets]
    # dp = 3: sizes are multiples of lcm(3, 128) = 384; 9025 -> 24 * 384 = 9216
    assert [b.size for b in bucket_layout(params, 3, bucket_size=9000, forward_order=order).buckets] == [9216] * 10
    # NCCL padding: multiples of 65536
    assert [
        b.size for b in bucket_layout(params, 8, bucket_size=9000, forward_order=order, pad_for_nccl=True).buckets
    ] == [65536] * 10


def test_mixed_dtypes_never_share_a_bucket():
    params = {
        "a": jax.ShapeDtypeStruct((100,), jnp.float32),
        "b": jax.ShapeDtypeStruct((100,), jnp.bfloat16),
        "c": jax.ShapeDtypeStruct((100,), jnp.float32),
    }
    layout = bucket_layout(params, 8, bucket_size=None)
    assert len(layout) == 2
    for b in layout.buckets:
        assert {np.dtype(params[s.name].dtype) for s in b.slots} == {b.dtype}


def test_pack_unpack_round_trips_exactly():
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.normal(size=(7, 5)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(5,)), jnp.float32),
        "h": jnp.asarray(rng.normal(size=(3, 11)), jnp.bfloat16),
        "e": jnp.asarray(rng.normal(size=(13,)), jnp.float32),
    }
    layout = bucket_layout(params, 8, bucket_size=40, shared=("e",))
    flats = pack(layout, params)
    assert [f.shape for f in flats] == [(b.size,) for b in layout.buckets]
    back = unpack(layout, flats)
    for k in params:
        assert back[k].dtype == params[k].dtype
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(params[k]))
    # gaps and padding are zeros: the buffer sums to the parameters' sum
    total = sum(float(jnp.sum(f.astype(jnp.float32))) for f in flats)
    assert total == pytest.approx(sum(float(jnp.sum(v.astype(jnp.float32))) for v in params.values()), rel=1e-6)


def test_layout_prints_as_a_table():
    params, order = linear_stack(bias=True)
    text = str(bucket_layout(params, 8, bucket_size=20000, forward_order=order))
    lines = text.splitlines()
    header = ["bucket", "dtype", "params", "used", "size", "padding", "segments", "first", "..", "last"]
    assert lines[0].split() == header
    assert lines[1].split()[:6] == ["0", "float32", "6", "27585", "27648", "63"]
    assert lines[-1] == "4 buckets, 92160 elements, dp=8"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dp": 0}, "dp must be a positive int"),
        ({"bucket_size": 0}, "bucket_size must be a positive int"),
        ({"forward_order": [0, 0]}, "forward_order must be a permutation"),
        ({"shared": ("nope",)}, "shared names"),
    ],
)
def test_bad_layout_arguments_raise(kwargs, message):
    params = {"a": jax.ShapeDtypeStruct((4,), jnp.float32), "b": jax.ShapeDtypeStruct((4,), jnp.float32)}
    kwargs = {"dp": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        bucket_layout(params, **kwargs)


def rank_major_case():
    rng = np.random.default_rng(1)
    params = {
        "w": jnp.asarray(rng.normal(size=(6, 16)), jnp.float32),  # split along dim 1 (16 > 6)
        "b": jnp.asarray(rng.normal(size=(7,)), jnp.float32),  # no dimension 4 divides: whole
        "k": jnp.asarray(rng.normal(size=(8, 4, 3)), jnp.float32),  # dim 0 (the first of 8 and 4)
        "h": jnp.asarray(rng.normal(size=(12,)), jnp.bfloat16),
    }
    return params, bucket_layout(params, 4, bucket_size=None, rank_major=True)


def test_rank_major_layout_splits_each_parameter_along_its_first_divisible_dim():
    params, layout = rank_major_case()
    slots = {s.name: (s.dim, b.ranks) for b in layout.buckets for s in b.slots}
    assert slots == {"w": (1, 4), "b": (None, 1), "k": (0, 4), "h": (0, 4)}
    assert [b.sharded for b in layout.buckets] == [b.ranks == 4 for b in layout.buckets]
    assert all(b.size % math.lcm(4, 128) == 0 for b in layout.buckets)
    assert "segments" in str(layout)
    # over one rank every parameter with a dimension is still "split" (reduce-scattered and gathered
    # over that rank, as ZeRO-1 on one GPU does), laid out in its own order
    one = bucket_layout(params, 1, bucket_size=None, rank_major=True)
    assert {b.sharded for b in one.buckets} == {True} and {b.ranks for b in one.buckets} == {1}
    back = unpack(one, pack(one, params))
    for k in params:
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(params[k]))


def test_rank_major_segments_hold_each_ranks_chunks():
    """A reduce-scatter of the buffer gives rank r segment r: it must hold exactly rank r's slice of
    every parameter along its dim (numpy slicing is the reference), and an all-gather of the
    segments packed from the slices must be the buffer, whose unpack is the parameters."""
    params, layout = rank_major_case()
    leaves = layout.treedef.flatten_up_to(params)
    for bucket in layout.buckets:
        flat = pack_bucket(bucket, leaves)
        assert flat.shape == (bucket.size,)
        for r in range(bucket.ranks):
            segment = flat[r * bucket.segment : (r + 1) * bucket.segment]
            chunks = {}
            for s in bucket.slots:
                x = np.asarray(leaves[s.leaf].astype(jnp.float32))
                n = s.shape[s.dim] // bucket.ranks if s.dim is not None else None
                chunks[s.leaf] = x if s.dim is None else np.take(x, range(r * n, (r + 1) * n), axis=s.dim)
            for leaf, piece in unpack_shard(bucket, segment).items():
                np.testing.assert_array_equal(np.asarray(piece.astype(jnp.float32)), chunks[leaf])
            packed = pack_shard(bucket, {k: jnp.asarray(v, bucket.dtype) for k, v in chunks.items()})
            np.testing.assert_array_equal(np.asarray(packed), np.asarray(segment))
    back = unpack(layout, pack(layout, params))
    for k in params:
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(params[k]))


def test_a_parameter_that_fills_its_segment_unpacks_exactly():
    """One parameter per rank-major bucket, each chunk the whole segment (no gaps, no padding): the
    unpack is a reshape of the buffer, along the first dimension and along a later one."""
    rng = np.random.default_rng(1)
    params = {
        "w": jnp.asarray(rng.normal(size=(4, 64)), jnp.float32),
        "v": jnp.asarray(rng.normal(size=(3, 128)), jnp.float32),
    }
    layout = bucket_layout(params, 2, bucket_size=1, rank_major=True)
    assert all(len(b.slots) == 1 and b.chunk(b.slots[0]) == b.segment for b in layout.buckets)
    assert sorted(b.slots[0].dim for b in layout.buckets) == [0, 1]  # w splits rows, v columns
    back = unpack(layout, pack(layout, params))
    for k in params:
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(params[k]))
    leaves = layout.treedef.flatten_up_to(params)
    for bucket in layout.buckets:
        s = bucket.slots[0]
        flat = pack_bucket(bucket, leaves)
        for r in range(2):
            n = s.shape[s.dim] // 2
            want = np.take(np.asarray(leaves[s.leaf]), range(r * n, (r + 1) * n), axis=s.dim)
            got = unpack_shard(bucket, flat[r * bucket.segment : (r + 1) * bucket.segment])[s.leaf]
            np.testing.assert_array_equal(np.asarray(got), want)
