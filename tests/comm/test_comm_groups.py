"""Grouped collectives: an op of `jaxdist.comm` given a tuple of arrays reduces, scatters or gathers
each of them in one group (one handle, a tuple of results) and gives what one op per array gives.

The xla backend runs here (8 CPU devices). The nccl backend's group (one FFI call, one NCCL group) is
lowered here for CUDA (its buffer aliasing) and run with its two FFI calls stood in for by `jax.lax`
collectives (its per-array layouts over several ranks); its start/wait pairing in a strategy's step
is read in tests/comm/test_nccl_lowering.py, its NCCL calls are issued against the test double in
tests/comm/test_nccl_protocol.py, and it runs on GPUs in tests/comm/test_nccl_gpu.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.meshes import cpu_mesh

from jaxdist import comm
from jaxdist.comm import nccl

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
            r"all_gather \(array 1 of the group\): expected an array, got str",
        ),
        (
            lambda x, t: comm.reduce_scatter((x, x[:3]), "dp", t),
            ValueError,
            r"reduce_scatter \(array 1 of the group\): dimension 0 of shape \(3, 2\) has size 3, which does not divide",
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


@pytest.fixture
def nccl_on_cpu(monkeypatch):
    """The nccl backend traceable without GPUs (tracing reads only a communicator's key)."""
    monkeypatch.setattr(nccl, "_comm_key", lambda axis_name: 7)
    monkeypatch.setattr(nccl, "nccl_backend", nccl.NcclBackend)


def test_an_nccl_group_keeps_every_input_alive_until_its_wait(nccl_on_cpu):
    """Lowered for CUDA: one start over the three arrays whose results 0..2 alias its inputs (XLA keeps
    them alive while NCCL reads them on the side stream), and one wait whose results alias the start's
    outputs 3..5 (what NCCL writes); both side-effecting."""

    def body(a, b, c):
        h, tok = comm.all_reduce_start((a, b, c), "dp", comm.token(), backend="nccl")
        return comm.wait(h, tok)[0]

    f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P(), out_specs=P(), check_vma=False))
    shapes = [jax.ShapeDtypeStruct(s, d) for s, d in (((4, 3), jnp.float32), ((5,), jnp.bfloat16), ((2, 2), jnp.int32))]
    text = f.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call @jaxdist" in line]
    assert [c.split("custom_call @")[1].split("(")[0] for c in calls] == [
        "jaxdist_nccl_start_group",
        "jaxdist_nccl_wait_group",
    ]
    start, wait = calls
    assert all("has_side_effect = true" in c for c in calls)
    for i in range(3):
        assert f"output_operand_alias<output_tuple_indices = [{i}], operand_index = {i}," in start
        assert f"output_operand_alias<output_tuple_indices = [{i}], operand_index = {3 + i}," in wait
    assert start.count("output_operand_alias<") == 3 and wait.count("output_operand_alias<") == 3


def test_an_nccl_group_larger_than_nccl_takes_is_refused_naming_the_fix(nccl_on_cpu, monkeypatch):
    """NCCL documents at most MAX_GROUP_CALLS (2048) calls between a ncclGroupStart and its ncclGroupEnd:
    a larger group is refused when traced (here with the limit lowered to 2), not issued."""
    monkeypatch.setattr(nccl, "MAX_GROUP_CALLS", 2)

    def body(a, b, c):
        h, tok = comm.all_gather_start((a, b, c), "dp", comm.token(), backend="nccl")
        return comm.wait(h, tok)[0]

    f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P(), out_specs=P(), check_vma=False))
    x = jax.ShapeDtypeStruct((4,), jnp.float32)
    with pytest.raises(ValueError, match=r"all_gather: a group of 3 arrays is more than the 2 calls .*pack_units=True"):
        f.trace(x, x, x)
    monkeypatch.setattr(nccl, "MAX_GROUP_CALLS", 3)
    f.trace(x, x, x)  # at the limit: traced


def _lax_stand_in(self, target, outs, *args, aliases=None, **attrs):
    """The two FFI calls of a group as `jax.lax` collectives over "dp" (4 ranks), on the leading
    dimension as NCCL works: what the nccl backend's own layout code feeds them and reads back."""
    if target == "jaxdist_nccl_wait_group":
        return tuple(args[len(args) // 2 :])
    assert target == "jaxdist_nccl_start_group", target
    kind, redop = attrs["kind"], attrs["redop"]  # nccl.py's _KIND and _REDOP
    ys = []
    for x, out in zip(args, outs[len(args) :], strict=True):
        if kind == 0:
            y = {0: jax.lax.psum, 1: jax.lax.pmean, 2: jax.lax.pmax, 3: jax.lax.pmin}[redop](x, "dp")
        elif kind == 1:
            y = jax.lax.all_gather(x, "dp", axis=0, tiled=True)
        else:
            y = jax.lax.psum_scatter(x, "dp", scatter_dimension=0, tiled=True)
            y = y / 4 if redop == 1 else y
        assert y.size == np.prod(out.shape), (y.shape, out.shape)
        ys.append(y.reshape(out.shape).astype(out.dtype))
    return (*args, *ys)


def test_the_nccl_groups_layouts_over_four_ranks_give_the_xla_backends_results(nccl_on_cpu, monkeypatch):
    """Per-array axes (split dims that are not the first moved to the front and back), untiled gathers,
    max and mean, a zero-size array: the nccl backend's group code around its FFI calls is exact."""
    monkeypatch.setattr(nccl.NcclBackend, "_call", _lax_stand_in)
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.integers(-8, 9, (4 * 4, 8)), jnp.float32)
    b = jnp.asarray(rng.integers(-8, 9, (4 * 8, 4)), jnp.float32)

    def body(a, b):
        c = a[:0]
        out = []
        for backend in ("nccl", "xla"):
            tok, r = comm.token(), []
            h, tok = comm.all_reduce_start((a, b, c), "dp", tok, op="mean", backend=backend)
            v, tok = comm.wait(h, tok)
            r += v
            v, tok = comm.all_reduce((a, b), "dp", tok, op="max", backend=backend)
            r += v
            h, tok = comm.reduce_scatter_start((a, b, c.T), "dp", tok, scatter_axis=(1, 0, 0), backend=backend)
            v, tok = comm.wait(h, tok)
            r += v
            v, tok = comm.all_gather((a, b), "dp", tok, axis=(1, 0), backend=backend)
            r += v
            v, tok = comm.all_gather((a, b), "dp", tok, axis=(2, 1), tiled=False, backend=backend)
            r += v
            out.append([x.reshape(1, -1).astype(jnp.float32) for x in r])
        return out

    got, want = _run(body, a, b)
    assert len(got) == len(want) == 12
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape, i
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=str(i))
