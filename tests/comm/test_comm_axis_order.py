"""Ranks along a tuple of mesh axes are numbered in tuple order, by every op and both backends.

For `axis_name=("b", "a")` a device's rank is `b_index * size_a + a_index`,
whatever the mesh's own axis order (jaxdist/comm/_ranks.py). The reference
below computes each device's rank from its mesh coordinates by that rule alone
and derives every op's result from it with NumPy.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from support.meshes import cpu_mesh

from jaxdist import comm
from jaxdist.comm import nccl

NAMES = ("a", "b")
CASES = [(shape, order) for shape in [(2, 4), (4, 2)] for order in [("a", "b"), ("b", "a")]]
CASE_IDS = [f"{'x'.join(map(str, s))}-{'+'.join(o)}" for s, o in CASES]
LOCAL = (8, 2)  # the scatter dimension divides over all 8 ranks


def _perm(n: int) -> list[tuple[int, int]]:
    # not symmetric under a reordering of the axes: rank n-1 only sends, rank 2 only receives
    return [(r, (r + 3) % n) for r in range(n - 1)]


OPS = ("rank", "all_gather", "reduce_scatter", "all_reduce", "sendrecv")
ALL_OPS = [*OPS, *(f"async_{op}" for op in OPS[1:])]  # every op, and every async pair


def tuple_order_rank(coords: dict[str, int], sizes: dict[str, int], order: tuple[str, ...]) -> int:
    """The rank rule: coordinates read as a mixed-radix number, the tuple's first axis most significant."""
    rank = 0
    for name in order:
        rank = rank * sizes[name] + coords[name]
    return rank


def _body(order, n, backend, x):
    x = x.reshape(LOCAL)
    tok = comm.token()
    out = {"rank": lax.axis_index(order) + jnp.zeros(LOCAL, jnp.int32)}
    out["all_gather"], tok = comm.all_gather(x, order, tok, backend=backend)
    out["reduce_scatter"], tok = comm.reduce_scatter(x, order, tok, backend=backend)
    out["all_reduce"], tok = comm.all_reduce(x, order, tok, backend=backend)
    out["sendrecv"], tok = comm.sendrecv(x, order, tok, perm=_perm(n), backend=backend)
    handles = {}
    handles["all_gather"], tok = comm.all_gather_start(x, order, tok, backend=backend)
    handles["reduce_scatter"], tok = comm.reduce_scatter_start(x, order, tok, backend=backend)
    handles["all_reduce"], tok = comm.all_reduce_start(x, order, tok, backend=backend)
    handles["sendrecv"], tok = comm.sendrecv_start(x, order, tok, perm=_perm(n), backend=backend)
    for name, h in handles.items():
        out[f"async_{name}"], tok = comm.wait(h, tok)
    return {k: v.reshape((1, 1, *v.shape)) for k, v in out.items()}


def _run(mesh, order, backend="xla"):
    shape = mesh.devices.shape
    g = np.arange(np.prod(shape) * np.prod(LOCAL), dtype=np.float32).reshape(shape[0] * LOCAL[0], shape[1] * LOCAL[1])
    spec = P(*NAMES)
    body = functools.partial(_body, order, mesh.devices.size, backend)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    out = f(jax.device_put(g, NamedSharding(mesh, spec)))
    return {k: np.asarray(v) for k, v in out.items()}, g


@functools.cache
def _run_on_cpu(shape, order):
    return _run(cpu_mesh(shape, NAMES), order)


def _reference(shape, order, g):
    """Each device's result, indexed by its mesh coordinates, from the rank rule alone."""
    sizes = dict(zip(NAMES, shape, strict=True))
    devices = [(i, j) for i in range(shape[0]) for j in range(shape[1])]
    block = {(i, j): g[i * LOCAL[0] : (i + 1) * LOCAL[0], j * LOCAL[1] : (j + 1) * LOCAL[1]] for i, j in devices}
    rank = {d: tuple_order_rank(dict(zip(NAMES, d, strict=True)), sizes, order) for d in devices}
    by_rank = [block[d] for d in sorted(devices, key=rank.get)]
    total = np.sum(by_rank, axis=0)
    source = {dst: src for src, dst in _perm(len(devices))}
    want = {}
    for d in devices:
        r = rank[d]
        want[d] = {
            "rank": np.full(LOCAL, r),
            "all_gather": np.concatenate(by_rank),
            "reduce_scatter": np.split(total, len(devices))[r],
            "all_reduce": total,
            "sendrecv": by_rank[source[r]] if r in source else np.zeros(LOCAL),
        }
    return want


@pytest.mark.parametrize(("shape", "order"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("op", ALL_OPS)
def test_xla_backend_numbers_tuple_axes_in_tuple_order(shape, order, op):
    got, g = _run_on_cpu(shape, order)
    _assert_matches(got, _reference(shape, order, g), op)


def _assert_matches(got, want, op):
    for (i, j), expected in want.items():
        np.testing.assert_array_equal(got[op][i, j], expected[op.removeprefix("async_")], err_msg=f"device {(i, j)}")


@pytest.mark.multigpu
@pytest.mark.parametrize("order", [("a", "b"), ("b", "a")], ids="+".join)
def test_nccl_backend_numbers_tuple_axes_in_tuple_order_on_four_gpus(order):
    gpus = jax.devices("gpu")
    if len(gpus) < 4:
        pytest.skip(f"needs 4 GPUs for a 2x2 mesh, found {len(gpus)}")
    mesh = Mesh(np.asarray(gpus[:4]).reshape(2, 2), NAMES, axis_types=(AxisType.Explicit,) * 2)
    nccl.init(mesh, axes=[order])
    got, g = _run(mesh, order, backend="nccl")
    want = _reference((2, 2), order, g)
    for op in ALL_OPS:
        _assert_matches(got, want, op)


@pytest.mark.parametrize(("shape", "order"), CASES, ids=CASE_IDS)
def test_nccl_communicator_rank_of_each_device_follows_the_tuple_order(shape, order):
    """nccl.init makes one communicator per row of `_groups`; a device's column is its NCCL rank,
    which is the rank all_gather, reduce_scatter and sendrecv's pairs use on that backend."""
    mesh = cpu_mesh(shape, NAMES)
    sizes = dict(zip(NAMES, shape, strict=True))
    coords = {d.id: dict(zip(NAMES, map(int, idx), strict=True)) for idx, d in np.ndenumerate(mesh.devices)}
    rows = nccl._groups(mesh, order)
    group_size = int(np.prod([sizes[n] for n in order]))
    assert rows.shape == (mesh.devices.size // group_size, group_size)
    for row in rows:
        others = {tuple(v for n, v in coords[d.id].items() if n not in order) for d in row}
        assert len(others) == 1, "a communicator spans devices that differ on an axis outside the group"
        assert [tuple_order_rank(coords[d.id], sizes, order) for d in row] == list(range(group_size))


def test_nccl_communicator_of_one_axis_in_a_2d_mesh():
    mesh = cpu_mesh((2, 4), NAMES)
    ids = np.vectorize(lambda d: d.id)(nccl._groups(mesh, ("a",)))
    np.testing.assert_array_equal(ids, np.vectorize(lambda d: d.id)(mesh.devices).T)


def test_nccl_communicators_of_one_tuple_in_two_orders_are_distinct(monkeypatch):
    # ("b", "a") numbers ranks differently from ("a", "b"), so one cannot stand in for the other
    mesh = cpu_mesh((2, 4), NAMES)
    monkeypatch.setattr(nccl, "_registry", {nccl._mesh_key(NAMES, (2, 4), ("a", "b")): 1})

    def body(x):
        assert nccl._comm_key(("a", "b")) == 1
        nccl._comm_key(("b", "a"))
        return x

    f = jax.shard_map(body, mesh=mesh, in_specs=P(*NAMES), out_specs=P(*NAMES))
    with pytest.raises(RuntimeError, match=r"call jaxdist.comm.nccl.init\(mesh, axes=\[\('b', 'a'\)\]\)"):
        jax.jit(f).lower(jax.ShapeDtypeStruct((2, 4), jnp.float32, sharding=NamedSharding(mesh, P(*NAMES))))
