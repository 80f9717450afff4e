"""Bad input to jaxdist.comm raises a clear error at trace time, before compilation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.meshes import cpu_mesh

from jaxdist import comm

MESH = cpu_mesh((2, 4), ("a", "b"))


def trace(body, shape=(8, 4), dtype=jnp.float32):
    """Lower (trace, no compile) `body` inside shard_map over MESH."""
    f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P("a"), out_specs=P("a"), check_vma=False))
    f.lower(jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(MESH, P("a"))))


def test_unknown_axis_name_names_the_axes_in_scope():
    with pytest.raises(ValueError, match=r"unknown mesh axis 'dp'.*\('a', 'b'\)"):
        trace(lambda x: comm.all_reduce(x, "dp", comm.token())[0])


def test_scatter_dimension_not_divisible_by_axis_size():
    with pytest.raises(ValueError, match="size 6, which does not divide evenly over the 4 ranks of axis 'b'"):
        trace(lambda x: comm.reduce_scatter(x, "b", comm.token(), scatter_axis=1)[0], shape=(8, 6))


def test_gather_axis_out_of_range():
    with pytest.raises(ValueError, match="axis=2 is out of range for an array of rank 2"):
        trace(lambda x: comm.all_gather(x, "b", comm.token(), axis=2)[0])


@pytest.mark.parametrize("dtype", [jnp.complex64, jnp.bool_])
def test_dtype_the_backend_does_not_support(dtype):
    with pytest.raises(TypeError, match=f"dtype {jnp.dtype(dtype).name} is not supported by the 'xla' backend"):
        trace(lambda x: comm.all_reduce(x, "b", comm.token())[0], dtype=dtype)


def test_mean_of_integers_is_refused():
    with pytest.raises(TypeError, match="op='mean' needs a floating dtype, got int32"):
        trace(lambda x: comm.all_reduce(x, "b", comm.token(), op="mean")[0], dtype=jnp.int32)


def test_unknown_reduce_op():
    with pytest.raises(ValueError, match=r"op='prod' is not supported; choose one of \('sum', 'mean'\)"):
        trace(lambda x: comm.reduce_scatter(x, "b", comm.token(), op="prod")[0])


@pytest.mark.parametrize("kind", ["all_reduce", "all_reduce_start", "reduce_scatter", "reduce_scatter_start"])
@pytest.mark.parametrize("op", [None, "SUM", 0])
def test_a_reduce_op_that_is_not_one_of_the_names_is_refused(kind, op):
    # op=None used to skip the check and sum
    allowed = r"\('sum', 'mean', 'max', 'min'\)" if kind.startswith("all_reduce") else r"\('sum', 'mean'\)"
    with pytest.raises(
        ValueError, match=rf"{kind.removesuffix('_start')}: op={op!r} is not supported; choose one of {allowed}"
    ):
        trace(lambda x: jax.tree.leaves(getattr(comm, kind)(x, "b", comm.token(), op=op))[0])


@pytest.mark.parametrize(
    "perm",
    [[(0, 1.5)], [(0, 1.0)], [("0", "1")], [(True, 1)], [(0, np.float32(1))], [(0, None)]],
    ids=["float", "integral-float", "strings", "bool", "numpy-float", "none"],
)
def test_a_perm_rank_that_is_not_an_integer_is_refused(perm):
    # these were silently taken as (0, 1)
    with pytest.raises(TypeError, match=r"sendrecv: perm pair .* holds a non-integer rank; ranks are ints"):
        trace(lambda x: comm.sendrecv(x, "b", comm.token(), perm=perm)[0])


def test_numpy_integer_ranks_are_ranks():
    perm = [(np.int64(0), np.int32(1)), (np.uint8(1), 0)]
    trace(lambda x: comm.sendrecv(x, "b", comm.token(), perm=perm)[0])


@pytest.mark.parametrize(
    "perm,message",
    [
        ([(0, 1), (0, 2)], r"duplicate source rank\(s\) \[0\]"),
        ([(0, 1), (2, 1)], r"duplicate destination rank\(s\) \[1\]"),
        ([(0, 4)], "rank 4 in perm is out of range for axis 'b' of size 4"),
        ([(-1, 0)], "rank -1 in perm is out of range"),
    ],
)
def test_bad_perm(perm, message):
    with pytest.raises(ValueError, match=message):
        trace(lambda x: comm.sendrecv(x, "b", comm.token(), perm=perm)[0])


def test_a_handle_waited_twice():
    def body(x):
        h, t = comm.all_reduce_start(x, "b", comm.token())
        y, t = comm.wait(h, t)
        return comm.wait(h, t)[0]

    with pytest.raises(ValueError, match="already waited"):
        trace(body)


def test_a_handle_waited_with_another_chain():
    def body(x):
        h, _ = comm.all_gather_start(x, "b", comm.token("dp"))
        return comm.wait(h, comm.token("tp"))[0]

    with pytest.raises(ValueError, match="started on token chain 'dp' but is waited with a token of chain 'tp'"):
        trace(body)


def test_a_token_that_is_not_a_token():
    with pytest.raises(TypeError, match="expected an ordering token from jaxdist.comm.token()"):
        trace(lambda x: comm.all_reduce(x, "b", jnp.zeros((), jnp.uint8))[0])


def test_unknown_backend_name():
    with pytest.raises(ValueError, match=r"unknown comm backend 'mpi'; choose one of \('xla', 'nccl'\)"):
        trace(lambda x: comm.all_reduce(x, "b", comm.token(), backend="mpi")[0])
    with pytest.raises(ValueError, match="unknown comm backend"):
        comm.set_default_backend("mpi")


def test_default_backend_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("JAXDIST_COMM_BACKEND", "nccl")
    assert comm.default_backend() == "nccl"
    monkeypatch.setenv("JAXDIST_COMM_BACKEND", "xla")
    assert comm.default_backend() == "xla"
