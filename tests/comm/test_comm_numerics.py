"""Every comm op and async pair against an independent NumPy reference.

Inputs are small integers, so every dtype holds them, their sums and their
means over 2, 4 or 8 ranks exactly: results must match the float64 reference
bit for bit. One float32 case with random normal values checks general floats.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.comm_ops import OPS, chain_perm, run_all_ops
from support.meshes import MESH_AXES, cpu_mesh, mesh_axes_id

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16, "int32": jnp.int32}
# (local shape, gather/untiled axis, scatter axis): reduce_scatter needs a dim divisible by 8
SHAPES = {"16x3": ((16, 3), 1, 0), "2x8x4": ((2, 8, 4), 0, 1)}


@functools.cache
def _results(case_index: int, dtype_name: str, shape_name: str, random_floats: bool = False):
    mesh_shape, names, axis = MESH_AXES[case_index]
    local, gather_axis, scatter_axis = SHAPES[shape_name]
    dtype = DTYPES[dtype_name]
    integer = np.issubdtype(np.dtype(dtype), np.integer)
    rng = np.random.default_rng(case_index)
    full_shape = mesh_shape + local
    if random_floats:
        g = rng.standard_normal(full_shape)
    else:
        g = rng.integers(-8, 9, size=full_shape).astype(np.float64)
    mesh = cpu_mesh(mesh_shape, names)
    group = axis if isinstance(axis, tuple) else (axis,)
    n = int(np.prod([mesh_shape[names.index(a)] for a in group]))
    lead = (1,) * len(mesh_shape)

    def body(block):
        x = block.reshape(local)
        out = run_all_ops(x, axis, n, gather_axis, scatter_axis, integer)
        return {k: v.reshape(lead + v.shape) for k, v in out.items()}

    spec = P(*names)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    x = jax.device_put(jnp.asarray(g, dtype=dtype), NamedSharding(mesh, spec))
    got = {k: np.asarray(v).astype(np.float64) for k, v in fn(x).items()}
    want = _reference(np.asarray(x).astype(np.float64), mesh_shape, names, group, gather_axis, scatter_axis, n)
    return got, want


def _reference(g, mesh_shape, names, group, gather_axis, scatter_axis, n):
    """Per-device results in float64, computed from the global array by NumPy alone."""
    gdims = [names.index(a) for a in group]
    other = [d for d in range(len(mesh_shape)) if d not in gdims]
    k = len(other)  # after the group dim come the other mesh dims, then the local dims
    gm = np.transpose(g, gdims + other + list(range(len(mesh_shape), g.ndim)))
    gm = gm.reshape((n,) + gm.shape[len(gdims) :])
    total = gm.sum(0)
    ranks = range(n)
    perm = dict((d, s) for s, d in chain_perm(n))
    per_rank = {
        "all_reduce_sum": [total] * n,
        "all_reduce_mean": [total / n] * n,
        "all_reduce_max": [gm.max(0)] * n,
        "all_reduce_min": [gm.min(0)] * n,
        "all_gather_tiled": [np.concatenate(list(gm), axis=k + gather_axis)] * n,
        "all_gather_stacked": [np.stack(list(gm), axis=k + gather_axis)] * n,
        "reduce_scatter_sum": np.split(total, n, axis=k + scatter_axis),
        "reduce_scatter_mean": [c / n for c in np.split(total, n, axis=k + scatter_axis)],
        "sendrecv": [gm[perm[r]] if r in perm else np.zeros_like(gm[0]) for r in ranks],
    }
    per_rank["async_all_reduce"] = per_rank["all_reduce_sum"]
    per_rank["async_all_gather"] = per_rank["all_gather_tiled"]
    per_rank["async_reduce_scatter"] = per_rank["reduce_scatter_sum"]
    per_rank["async_sendrecv"] = per_rank["sendrecv"]
    want = {}
    for name, rows in per_rank.items():
        r = np.stack(rows)  # (n, *other mesh dims, *local result)
        r = r.reshape(tuple(mesh_shape[d] for d in gdims) + r.shape[1:])
        order = gdims + other
        inverse = [order.index(d) for d in range(len(mesh_shape))]
        want[name] = np.transpose(r, inverse + list(range(len(mesh_shape), r.ndim)))
    return want


# mean is defined for floating dtypes only (int32 mean is a TypeError, see test_comm_errors)
OP_DTYPES = [(op, d) for op in OPS for d in DTYPES if not (d == "int32" and op.endswith("_mean"))]


# every dtype on the 16x3 shape and float32 on both (each gathers and scatters along another axis) in the fast
# run; the other dtypes on 2x8x4 with the slow tests
OP_DTYPE_SHAPES = [
    pytest.param(op, d, s, marks=pytest.mark.slow if (s == "2x8x4" and d != "float32") else (), id=f"{op}-{d}-{s}")
    for op, d in OP_DTYPES
    for s in SHAPES
]


@pytest.mark.parametrize("case_index", range(len(MESH_AXES)), ids=[mesh_axes_id(c) for c in MESH_AXES])
@pytest.mark.parametrize(("op", "dtype_name", "shape_name"), OP_DTYPE_SHAPES)
def test_op_matches_numpy_reference(op, dtype_name, case_index, shape_name):
    got, want = _results(case_index, dtype_name, shape_name)
    np.testing.assert_array_equal(got[op], want[op], err_msg=op)


@pytest.mark.parametrize("case_index", range(len(MESH_AXES)), ids=[mesh_axes_id(c) for c in MESH_AXES])
def test_random_float32_values_match_within_rounding(case_index):
    got, want = _results(case_index, "float32", "16x3", random_floats=True)
    for op in OPS:
        # float32 sums of at most 8 terms of size ~1: a few ulps
        np.testing.assert_allclose(got[op], want[op], rtol=1e-5, atol=1e-5, err_msg=op)
