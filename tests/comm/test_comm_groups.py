"""Grouped collectives: an op of `jaxdist.comm` given a tuple of arrays reduces, scatters or gathers
each of them in one group (one handle, a tuple of results) and gives what one op per array gives.

The xla backend runs here (8 CPU devices); the nccl backend's group (one FFI call, one NCCL group) is
read from its lowering in tests/comm/test_nccl_lowering.py, issued against the test double in
tests/comm/test_nccl_protocol.py and run on GPUs in tests/comm/test_nccl_gpu.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.meshes import cpu_mesh

from jaxdist import comm

MESH = cpu_mesh((4,), ("dp",))


def _run(body, *arrays):
    f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P("dp"), out_specs=P("dp"), check_vma=False))
    return f(*(jax.device_put(a, NamedSharding(MESH, P("dp"))) for a in arrays))


def test_each_collective_of_a_group_equals_one_op_per_array():
    """Two dtypes, per-array axes, a zero-size array (reduced and scattered), the async pair and the
    one-call form."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.integers(-8, 9, (4 * 8, 4)), jnp.float32)
    b = jnp.asarray(rng.integers(-8, 9, (4 * 4, 8)), jnp.bfloat16)

    def body(a, b):
        c = a[:0]
        tok = comm.token()
        grouped = {}
        h, tok = comm.all_reduce_start((a, b, c), "dp", tok, op="mean")
        grouped["all_reduce"], tok = comm.wait(h, tok)
        grouped["max"], tok = comm.all_reduce((a, b), "dp", tok, op="max")
        h, tok = comm.reduce_scatter_start((a, b, c.T), "dp", tok, scatter_axis=(0, 1, 0))
        grouped["reduce_scatter"], tok = comm.wait(h, tok)
        grouped["all_gather"], tok = comm.all_gather((a, b), "dp", tok, axis=(1, 0))
        grouped["stacked"], tok = comm.all_gather((a, b), "dp", tok, axis=0, tiled=False)
        one = {}
        one["all_reduce"] = tuple(comm.all_reduce(x, "dp", tok, op="mean")[0] for x in (a, b, c))
        one["max"] = tuple(comm.all_reduce(x, "dp", tok, op="max")[0] for x in (a, b))
        one["reduce_scatter"] = tuple(
            comm.reduce_scatter(x, "dp", tok, scatter_axis=d)[0] for x, d in ((a, 0), (b, 1), (c.T, 0))
        )
        one["all_gather"] = tuple(comm.all_gather(x, "dp", tok, axis=d)[0] for x, d in ((a, 1), (b, 0)))
        one["stacked"] = tuple(comm.all_gather(x, "dp", tok, axis=0, tiled=False)[0] for x in (a, b))
        flat = lambda results: [x.reshape(1, -1).astype(jnp.float32) for x in jax.tree.leaves(results)]  # noqa: E731
        return flat(grouped), flat(one)

    grouped, one = _run(body, a, b)
    assert len(grouped) == len(one) == 12
    for g, o in zip(grouped, one, strict=True):
        assert g.shape == o.shape
        np.testing.assert_array_equal(np.asarray(g), np.asarray(o))


def test_a_grouped_all_reduce_compiles_to_one_variadic_all_reduce():
    """The xla backend starts a group's all-reduces together (between the same two barriers of the token
    chain), so XLA's combiner makes them one all-reduce over every array: no concatenation, no copies."""

    def body(a, b):
        (x, y), _ = comm.all_reduce((a, b), "dp", comm.token())
        return x, y

    f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P("dp"), out_specs=P("dp"), check_vma=False))
    placed = (jax.device_put(jnp.ones(s), NamedSharding(MESH, P("dp"))) for s in ((8, 3), (4, 5)))
    hlo = f.lower(*placed).compile().as_text()
    reduces = [line for line in hlo.splitlines() if " all-reduce(" in line]
    assert len(reduces) == 1 and "f32[2,3]" in reduces[0] and "f32[1,5]" in reduces[0], reduces
    assert "concatenate" not in hlo


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda x, t: comm.all_reduce_start((), "dp", t), ValueError, r"all_reduce: a group needs at least one array"),
        (
            lambda x, t: comm.sendrecv_start((x, x), "dp", t, perm=[(0, 1)]),
            TypeError,
            r"sendrecv: takes one array; a group holds collectives",
        ),
        (
            lambda x, t: comm.reduce_scatter_start((x, x), "dp", t, scatter_axis=(0,)),
            ValueError,
            r"reduce_scatter: scatter_axis has 1 entries for a group of 2 arrays",
        ),
        (
            lambda x, t: comm.all_gather((x, "x"), "dp", t),
            TypeError,
            r"all_gather: expected an array, got str",
        ),
        (
            lambda x, t: comm.reduce_scatter((x, x[:3]), "dp", t),
            ValueError,
            r"reduce_scatter",  # the second array's 3 rows do not divide over 4 ranks
        ),
    ],
    ids=["empty", "sendrecv", "axes-length", "not-an-array", "indivisible"],
)
def test_a_bad_group_is_refused_with_its_reason(call, error, match):
    def body(x):
        call(x, comm.token())
        return x

    with pytest.raises(error, match=match):
        _run(body, jnp.ones((16, 2)))


def test_a_group_handle_is_waited_once():
    def body(x):
        tok = comm.token()
        h, tok = comm.all_reduce_start((x, x), "dp", tok)
        _, tok = comm.wait(h, tok)
        comm.wait(h, tok)
        return x

    with pytest.raises(ValueError, match=r"already waited; each handle is waited exactly once"):
        _run(body, jnp.ones((16, 2)))
