"""A handle is waited only inside the shard_map that started it, on either backend.

Returned from its shard_map, a handle's buffers become one global array made of
every device's in-flight buffer: waiting it outside, or in a second shard_map,
used to return that (or fail deep inside JAX). Now `wait` refuses it at trace
time. Waiting in the same shard_map, also across a scan or an inner jit with the
xla backend, still works.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from support.meshes import cpu_mesh

from jaxdist import comm
from jaxdist.comm import Handle

MESH = cpu_mesh((8,), ("x",))
REFUSED = r"wait: this all_gather handle is waited outside the shard_map it was started in"


def _start(backend: str):
    """A shard_map body that starts an all_gather and returns its handle, unwaited."""

    def body(v):
        if backend == "xla":
            return comm.all_gather_start(v, "x", comm.token())[0]
        # The nccl backend's start needs a GPU; its handle is the same type, built the way _start builds it.
        params = (("axis", 0), ("axis_name", "x"), ("op_id", 1), ("size", 8), ("tiled", True))
        return Handle((v, jnp.tile(v, 8)), "all_gather", "default", "nccl", params)

    return jax.shard_map(body, mesh=MESH, in_specs=P("x"), out_specs=P("x"))


def _x():
    return jax.device_put(jnp.arange(8.0), NamedSharding(MESH, P("x")))


@pytest.mark.parametrize("backend", ["xla", "nccl"])
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_a_handle_returned_from_shard_map_is_refused_by_wait_outside(backend, jit):
    def outside(x):
        return comm.wait(_start(backend)(x), comm.token())[0]

    with pytest.raises(ValueError, match=REFUSED):
        (jax.jit(outside) if jit else outside)(_x())


@pytest.mark.parametrize("backend", ["xla", "nccl"])
def test_a_handle_returned_from_shard_map_is_refused_by_wait_in_a_second_shard_map(backend):
    def two_shard_maps(x):
        h = _start(backend)(x)
        wait_in_second = jax.shard_map(
            lambda h: comm.wait(h, comm.token())[0], mesh=MESH, in_specs=P("x"), out_specs=P("x")
        )
        return wait_in_second(h)

    with pytest.raises(ValueError, match=REFUSED):
        jax.jit(two_shard_maps)(_x())


def test_a_handle_waited_in_its_own_shard_map_through_scan_and_an_inner_jit():
    def body(v):
        tok = comm.token()
        h, tok = comm.all_gather_start(v, "x", tok)

        def step(carry, _):  # the handle rides the scan carry, unwaited
            return carry, None

        h, _ = jax.lax.scan(step, h, None, length=2)
        gathered, tok = jax.jit(comm.wait)(h, tok)
        h, tok = comm.all_reduce_start(v, "x", tok)

        def wait_then_restart(carry, _):  # waited in the next iteration, as a pipelined loop does
            h, t = carry
            y, t = comm.wait(h, t)
            return comm.all_reduce_start(y, "x", t), None

        (h, tok), _ = jax.lax.scan(wait_then_restart, (h, tok), None, length=2)
        total, tok = comm.wait(h, tok)
        return gathered, total

    f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P("x"), out_specs=(P(), P()), check_vma=False))
    gathered, total = f(_x())
    np.testing.assert_array_equal(np.asarray(gathered), np.arange(8.0))
    np.testing.assert_array_equal(np.asarray(total), [28.0 * 8 * 8])  # summed over 8 ranks 3 times


def test_a_handle_waited_in_a_shard_map_over_part_of_the_mesh():
    mesh = cpu_mesh((2, 4), ("a", "b"))

    def body(v):
        h, tok = comm.all_gather_start(v, "a", comm.token())
        return comm.wait(h, tok)[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("a"), out_specs=P(), axis_names={"a"}, check_vma=False))
    x = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("a")))
    np.testing.assert_array_equal(np.asarray(f(x)), np.arange(4.0))


@pytest.mark.gpu
def test_a_real_nccl_handle_returned_from_shard_map_is_refused():
    from jaxdist.comm import nccl

    mesh = Mesh(np.asarray(jax.devices("gpu")[:1]), ("g",), axis_types=(AxisType.Explicit,))
    nccl.init(mesh)

    def start(v):
        return comm.all_gather_start(v, "g", comm.token(), backend="nccl")[0]

    def outside(x):
        h = jax.shard_map(start, mesh=mesh, in_specs=P("g"), out_specs=P("g"))(x)
        return comm.wait(h, comm.token())[0]

    with pytest.raises(ValueError, match=REFUSED):
        jax.jit(outside).lower(jax.ShapeDtypeStruct((4,), jnp.float32, sharding=NamedSharding(mesh, P("g"))))
