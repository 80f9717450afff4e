"""Both comm backends type their results as `jax.lax` does under `shard_map(check_vma=True)`:
an all-reduce is invariant over its axes, the other ops vary over them, and every other axis
keeps the input's type. The nccl ops are only traced here (abstractly, with no communicator),
so the check runs without GPUs."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from support.meshes import cpu_mesh

from jaxdist.comm import nccl
from jaxdist.comm.xla import XLA_BACKEND
from jaxdist.compat import varying_axes

OPS = {
    "all_reduce": {"op": "sum"},
    "all_gather": {"axis": 0, "tiled": True},
    "reduce_scatter": {"op": "sum", "scatter_axis": 0},
    "sendrecv": {"perm": ((0, 1), (1, 0))},
}


@pytest.mark.parametrize("varies", [(), ("a",), ("b",), ("a", "b")], ids=["none", "a", "b", "ab"])
@pytest.mark.parametrize("kind", list(OPS))
def test_results_vary_over_the_axes_jax_lax_gives_them_with_both_backends(kind, varies, monkeypatch):
    monkeypatch.setattr(nccl, "_comm_key", lambda axis_name: 0)  # an abstract trace needs no communicator
    backends = {"xla": XLA_BACKEND, "nccl": nccl.NcclBackend()}
    seen = {}

    def body(x):
        if varies:
            x = jax.lax.pcast(x, varies, to="varying")
        for name, backend in backends.items():
            sync = getattr(backend, kind)(x, "a", **OPS[kind], size=2)
            params = {**OPS[kind], "size": 2}
            done = backend.finish(kind, backend.start(kind, x, "a", params), "a", params)
            seen[name] = (varying_axes(sync), varying_axes(done))
        return jnp.zeros(())

    mesh = cpu_mesh((2, 2), ("a", "b"))
    traced = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=True)
    jax.eval_shape(traced, jax.ShapeDtypeStruct((4, 3), jnp.float32))
    expected = set(varies) - {"a"} if kind == "all_reduce" else set(varies) | {"a"}
    assert seen["xla"] == (expected, expected)
    assert seen["nccl"] == seen["xla"]


def test_nccl_ops_are_side_effecting_in_the_hlo_and_leave_the_jaxpr_effect_free(monkeypatch):
    """XLA must keep every NCCL call where the program has it (no DCE, CSE or remat: the HLO custom call is
    side-effecting), while the jaxpr carries no effect: with one, jit dispatches every call of a train
    step through Python (on GPU, +27 ms of host time per GPT-350M step). Lowered for CUDA, so no GPU
    is needed."""
    monkeypatch.setattr(nccl, "_comm_key", lambda axis_name: 7)
    backend = nccl.NcclBackend()
    params = {"axis": 0, "tiled": True, "size": 2}

    def body(x):
        total = backend.all_reduce(x, "a", op="sum", size=2)
        gathered = backend.finish("all_gather", backend.start("all_gather", total, "a", params), "a", params)
        swapped = backend.sendrecv(x, "a", perm=((0, 1), (1, 0)), size=2)
        return gathered.sum() + swapped.sum()

    step = jax.jit(jax.shard_map(body, mesh=cpu_mesh((2,), ("a",)), in_specs=P(), out_specs=P(), check_vma=False))
    x = jax.ShapeDtypeStruct((4, 3), jnp.float32)
    assert not jax.make_jaxpr(step)(x).effects
    calls = [
        line
        for line in step.trace(x).lower(lowering_platforms=("cuda",)).as_text().splitlines()
        if "custom_call @jaxdist" in line
    ]
    targets = [line.split("custom_call @")[1].split("(")[0] for line in calls]
    assert targets == ["jaxdist_nccl_collective", "jaxdist_nccl_start", "jaxdist_nccl_wait", "jaxdist_nccl_collective"]
    assert all("has_side_effect = true" in line for line in calls)
    assert "perm_src = dense<[0, 1]>" in calls[3] and "kind = 3" in calls[3]
    assert "output_operand_alias<output_tuple_indices = [0], operand_index = 0" in calls[1]  # the start keeps x alive


def test_nccl_ops_are_never_dead_code_a_wait_whose_result_is_unused_and_a_collective_in_one_branch_included(
    monkeypatch,
):
    """An effect-free equation whose results are unused is dropped by jit; these must not be: a dropped
    wait (its start kept, its token feeding later ops) lets XLA free buffers NCCL still writes, and a
    collective dropped in one branch of a cond on the rank hangs the ranks that take the other."""
    monkeypatch.setattr(nccl, "_comm_key", lambda axis_name: 7)
    backend = nccl.NcclBackend()
    params = {"axis": 0, "tiled": True, "size": 2}

    def body(x):
        handle = backend.start("all_gather", x, "a", params)
        backend.finish("all_gather", handle, "a", params)  # the gathered value is never read
        unused_in_one_branch = jax.lax.cond(
            jax.lax.axis_index("a") == 0,
            lambda y: (backend.all_reduce(y, "a", op="sum", size=2), y)[1],
            lambda y: backend.all_reduce(y, "a", op="sum", size=2),
            x,
        )
        return unused_in_one_branch.sum()

    step = jax.jit(jax.shard_map(body, mesh=cpu_mesh((2,), ("a",)), in_specs=P(), out_specs=P(), check_vma=False))
    hlo = step.trace(jax.ShapeDtypeStruct((4, 3), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("custom_call @jaxdist_nccl_start") == 1
    assert hlo.count("custom_call @jaxdist_nccl_wait") == 1
    assert hlo.count("custom_call @jaxdist_nccl_collective") == 2  # one in each branch
