"""Tokens order communication: in the scheduled HLO, and through jit, scan and fori_loop."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.meshes import cpu_mesh

from jaxdist import comm

MESH = cpu_mesh((8,), ("x",))
# one distinct column count per op, so each collective can be found in the HLO by its shape
WIDTHS = {"all_reduce": 3, "all_gather": 5, "reduce_scatter": 7, "sendrecv": 9, "all_reduce_max": 11}
CALLS = {
    "all_reduce": lambda v, t: comm.all_reduce(v, "x", t),
    "all_gather": lambda v, t: comm.all_gather(v, "x", t),
    "reduce_scatter": lambda v, t: comm.reduce_scatter(v, "x", t),
    "sendrecv": lambda v, t: comm.sendrecv(v, "x", t, perm=[(0, 1), (1, 0)]),
    "all_reduce_max": lambda v, t: comm.all_reduce(v, "x", t, op="max"),
}


def _scheduled_collectives(chain_order, chained):
    """Compile ops whose inputs are independent; return op names in scheduled order."""
    names = list(WIDTHS)

    def body(*xs):
        t = comm.token()
        outs = {}
        for name in chain_order:
            outs[name], t2 = CALLS[name](xs[names.index(name)], t if chained else comm.token())
            t = t2 if chained else t
        return tuple(outs[n].sum() for n in names)

    args = [jax.ShapeDtypeStruct((64, w), jnp.float32, sharding=NamedSharding(MESH, P("x"))) for w in WIDTHS.values()]
    f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(P("x"),) * 5, out_specs=(P(),) * 5, check_vma=False))
    hlo = f.lower(*args).compile().as_text()
    entry = hlo[hlo.index("ENTRY") :]
    order = []
    for line in entry.splitlines():
        m = re.search(
            r"= f32\[\d+,(\d+)\]\{[0-9,]*\} (all-reduce|all-gather|reduce-scatter|collective-permute)\(", line
        )
        if m:
            order.append(next(n for n, w in WIDTHS.items() if w == int(m.group(1))))
    return order


def test_ops_on_one_chain_are_scheduled_in_chain_order():
    chain = ["all_reduce_max", "sendrecv", "reduce_scatter", "all_gather", "all_reduce"]
    assert _scheduled_collectives(chain, chained=True) == chain
    other = ["reduce_scatter", "all_reduce", "all_reduce_max", "all_gather", "sendrecv"]
    assert _scheduled_collectives(other, chained=True) == other


def test_without_a_chain_xla_picks_its_own_order():
    # The control: the same ops on separate tokens are not scheduled in the
    # order written, so the test above could fail.
    chain = ["all_reduce_max", "sendrecv", "reduce_scatter", "all_gather", "all_reduce"]
    assert _scheduled_collectives(chain, chained=False) != chain


def _run(body, x):
    f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P("x"), out_specs=P("x")))
    return np.asarray(f(jax.device_put(x, NamedSharding(MESH, P("x")))))


def test_token_is_a_scan_carry_with_async_ops_across_iterations():
    # a ring: each step starts the next shift before waiting for the current one
    def body(x):
        def step(carry, _):
            h, t, acc = carry
            cur, t = comm.wait(h, t)
            nxt, t = comm.sendrecv_start(cur, "x", t, perm=[(i, (i + 1) % 8) for i in range(8)])
            return (nxt, t, acc + cur), None

        h, t = comm.sendrecv_start(x, "x", comm.token(), perm=[(i, (i + 1) % 8) for i in range(8)])
        (h, t, acc), _ = jax.lax.scan(step, (h, t, jnp.zeros_like(x)), None, length=7)
        last, t = comm.wait(h, t)
        return acc + x

    x = jnp.arange(8.0)
    # after 7 shifts every rank has summed all 8 values
    np.testing.assert_array_equal(_run(body, x), np.full(8, 28.0))


def test_token_is_a_fori_loop_carry():
    def body(x):
        def step(i, c):
            v, t = c
            v, t = comm.all_reduce(v, "x", t, op="mean")
            # the mean is the same on every rank; the carry type says varying
            return jax.lax.pcast(v, "x", to="varying") + 1.0, t

        v, _ = jax.lax.fori_loop(0, 3, step, (x, comm.token()))
        return v

    x = jnp.arange(8.0)
    # mean 3.5, then +1, mean, +1, mean, +1
    np.testing.assert_array_equal(_run(body, x), np.full(8, 6.5))


def test_a_token_can_be_returned_from_shard_map_as_replicated():
    def body(x):
        y, t = comm.all_reduce(x, "x", comm.token())
        return y, t

    f = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P("x"), out_specs=(P("x"), P())))
    y, t = f(jax.device_put(jnp.ones(8), NamedSharding(MESH, P("x"))))
    assert isinstance(t, comm.Token) and t.value.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(y), np.full(8, 8.0))


def test_gradients_flow_through_comm_ops():
    # d/dx sum(all_gather(x)) over 8 ranks: each element is gathered to 8 ranks
    def loss(x):
        def body(v):
            g, _ = comm.all_gather(v, "x", comm.token())
            return g.sum(keepdims=True)

        return jax.shard_map(body, mesh=MESH, in_specs=P("x"), out_specs=P("x"))(x).sum()

    x = jax.device_put(jnp.arange(8.0), NamedSharding(MESH, P("x")))
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.grad(loss))(x)), np.full(8, 8.0))


def test_a_handle_knows_when_it_crossed_a_loop_boundary():
    """The nccl backend refuses such handles (XLA may copy a loop carry before NCCL wrote it);
    this checks the detection on the xla backend, which needs no refusal."""
    mesh = cpu_mesh((8,), ("x",))
    seen = {}

    def body(v):
        tok = comm.token()
        h, tok = comm.all_gather_start(v, "x", tok)
        seen["direct"] = h.crossed_boundary()

        def step(carry, _):
            seen["carried"] = carry.crossed_boundary()
            return carry, None

        carried, _ = jax.lax.scan(step, h, None, length=1)
        y, tok = comm.wait(h, tok)
        return y

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P(), check_vma=False))
    f.lower(jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, P("x"))))
    assert seen == {"direct": False, "carried": True}
