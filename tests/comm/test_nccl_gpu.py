"""The nccl backend on real GPUs, against the xla backend.

`gpu` tests run on one GPU with one-rank communicators (a send/recv to self
inside a group is legal); `multigpu` tests need two or more GPUs. Both skip
elsewhere. Run them with `bash .ci/gpu` on a GPU runner.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from support.comm_ops import OPS
from support.comm_ops import run_all_ops as _run_all_ops

from jaxdist import comm

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.int8, jnp.uint8]


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def _mesh(n: int, axis: str) -> Mesh:
    return Mesh(np.asarray(_gpus()[:n]), (axis,), axis_types=(AxisType.Explicit,))


def _both_backends(mesh, axis, x, body):
    """Run `body` with the nccl backend and with the xla backend; return both results."""
    out = {}
    for backend in ("nccl", "xla"):
        comm.set_default_backend(backend)
        try:
            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis), check_vma=False))
            out[backend] = jax.tree.map(np.asarray, f(jax.device_put(x, NamedSharding(mesh, P(axis)))))
        finally:
            comm.set_default_backend("xla")
    return out["nccl"], out["xla"]


def _all_ops_body(axis, n, integer):
    def body(block):
        out = _run_all_ops(block[0], axis, n, gather_axis=1, scatter_axis=0, integer=integer)
        # a one-rank "ring": send to self
        out["self_sendrecv"], _ = comm.sendrecv(
            block[0], axis, comm.token(), perm=[(0, 0)] if n == 1 else [(i, (i + 1) % n) for i in range(n)]
        )
        return {k: v[None] for k, v in out.items()}

    return body


@pytest.mark.gpu
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_every_op_and_async_pair_matches_the_xla_backend_on_one_gpu(blocking, dtype):
    from jaxdist.comm import nccl

    axis = "one_blocking" if blocking else "one_nonblocking"
    mesh = _mesh(1, axis)
    nccl.init(mesh, blocking=blocking)
    integer = not jnp.issubdtype(dtype, jnp.floating)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(0, 9, size=(1, 16, 3)), dtype=dtype)
    got, want = _both_backends(mesh, axis, x, _all_ops_body(axis, 1, integer))
    assert set(got) == set(want) and set(OPS) - {o for o in OPS if integer and o.endswith("mean")} <= set(got)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def _grouped_body(axis):
    """Each collective over a group of arrays: two dtypes, per-array axes, an empty one (reduced and
    scattered), the async pair and the one-call form."""

    def body(block):
        a, b, c = block[0], block[0][:, :2].astype(jnp.bfloat16), block[0][:0]
        tok = comm.token()
        h, tok = comm.all_reduce_start((a, b, c), axis, tok, op="sum")
        reduced, tok = comm.wait(h, tok)
        scattered, tok = comm.reduce_scatter((a, b.T, c.T), axis, tok, op="mean", scatter_axis=(0, 1, 0))
        h, tok = comm.all_gather_start((a, b), axis, tok, axis=(1, 0))  # (XLA gathers no zero-size dim)
        gathered, tok = comm.wait(h, tok)
        out = {f"reduced{i}": v for i, v in enumerate(reduced)}
        out |= {f"scattered{i}": v for i, v in enumerate(scattered)}
        out |= {f"gathered{i}": v for i, v in enumerate(gathered)}
        return {k: v.astype(jnp.float32)[None] for k, v in out.items()}

    return body


@pytest.mark.gpu
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_a_group_of_collectives_matches_the_xla_backend_on_one_gpu(blocking):
    from jaxdist.comm import nccl

    axis = "group_blocking" if blocking else "group_nonblocking"
    mesh = _mesh(1, axis)
    nccl.init(mesh, blocking=blocking)
    x = jnp.asarray(np.random.default_rng(3).integers(0, 9, size=(1, 16, 3)), jnp.float32)
    got, want = _both_backends(mesh, axis, x, _grouped_body(axis))
    assert len(want) == 8
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.multigpu
def test_a_group_of_collectives_across_ranks_matches_the_xla_backend():
    from jaxdist.comm import nccl

    n = len(_gpus())
    axis = "group_all_gpus"
    mesh = _mesh(n, axis)
    nccl.init(mesh)
    x = jnp.asarray(np.random.default_rng(4).integers(0, 9, size=(n, 8 * n, 2 * n)), jnp.float32)
    got, want = _both_backends(mesh, axis, x, _grouped_body(axis))
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [False, True], ids=["one-op", "group"])
def test_results_read_after_wait_are_correct_with_a_delay_on_the_comm_stream(group):
    from jaxdist.comm import nccl

    mesh = _mesh(1, "race")
    nccl.init(mesh)

    def body(x):
        tok = comm.token()
        half = x.shape[0] // 2
        h, tok = comm.all_gather_start((x[:half], x[half:]) if group else x, "race", tok, backend="nccl")
        busy = jnp.sin(x) * 2  # compute that overlaps the delayed gather
        y, tok = comm.wait(h, tok)
        return (jnp.concatenate(y) if group else y) + busy * 0

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("race"), out_specs=P("race"), check_vma=False))
    sharding = NamedSharding(mesh, P("race"))

    def timed(delay_us, x):
        nccl.set_debug_delay(delay_us)
        try:
            t0 = time.perf_counter()
            y = np.asarray(f(jax.device_put(x, sharding)))
            return y, time.perf_counter() - t0
        finally:
            nccl.set_debug_delay(0)

    rng = np.random.default_rng(1)
    timed(0, jnp.zeros((1 << 20,), jnp.float32))  # compile
    for i in range(5):
        x = jnp.asarray(rng.standard_normal(1 << 20), jnp.float32) + i
        y, _ = timed(50_000, x)
        np.testing.assert_array_equal(y, np.asarray(x))
    # the control: the delay really sits on the stream the result waits for
    _, fast = timed(0, x)
    _, slow = timed(50_000, x)
    assert slow - fast > 0.040, (fast, slow)


@pytest.mark.gpu
def test_an_op_without_init_says_to_call_init():
    mesh = _mesh(1, "never_initialized")

    def body(x):
        return comm.all_reduce(x, "never_initialized", comm.token(), backend="nccl")[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("never_initialized"), out_specs=P("never_initialized")))
    with pytest.raises(RuntimeError, match=r"call jaxdist.comm.nccl.init\(mesh\)"):
        f.lower(jax.ShapeDtypeStruct((4,), jnp.float32, sharding=NamedSharding(mesh, P("never_initialized"))))


@pytest.mark.multigpu
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_two_rank_grouped_send_recv(blocking):
    # PyTorch's test_non_blocking_p2p scenario: rank 0 sends, rank 1 receives, repeatedly
    from jaxdist.comm import nccl

    axis = f"p2p_{int(blocking)}"
    mesh = _mesh(2, axis)
    nccl.init(mesh, blocking=blocking)
    for i in range(10):
        x = jnp.arange(2 * 1024, dtype=jnp.float32).reshape(2, 1024) + i
        got, want = _both_backends(mesh, axis, x, lambda b: comm.sendrecv(b, axis, comm.token(), perm=[(0, 1)])[0])
        np.testing.assert_array_equal(got, want)


@pytest.mark.multigpu
@pytest.mark.parametrize("poll", ["local", "yield", "spin"])
def test_every_poll_mode_gives_the_xla_backends_results_on_a_nonblocking_communicator(poll):
    # the poll mode changes where NCCL's group thread runs and how it is waited for, never the data
    from jaxdist.comm import nccl

    n = len(_gpus())
    axis = f"poll_{poll}"
    mesh = _mesh(n, axis)
    nccl.init(mesh, blocking=False)
    x = jnp.asarray(np.random.default_rng(3).integers(0, 9, size=(n, 8 * n, 3)), dtype=jnp.float32)
    nccl.set_poll_mode(poll)
    try:
        got, want = _both_backends(mesh, axis, x, _all_ops_body(axis, n, False))
    finally:
        nccl.set_poll_mode("local")
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.multigpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_every_collective_across_ranks_matches_the_xla_backend(dtype):
    from jaxdist.comm import nccl

    n = len(_gpus())
    axis = "all_gpus"
    mesh = _mesh(n, axis)
    nccl.init(mesh)
    integer = not jnp.issubdtype(dtype, jnp.floating)
    x = jnp.asarray(np.random.default_rng(2).integers(0, 9, size=(n, 8 * n, 3)), dtype=dtype)
    got, want = _both_backends(mesh, axis, x, _all_ops_body(axis, n, integer))
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


MULTIPROCESS_WORKER = """
import sys, jax, numpy as np, jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
jax.distributed.initialize("localhost:" + sys.argv[2], num_processes=2, process_id=int(sys.argv[1]))
from jaxdist import comm
from jaxdist.comm import nccl
mesh = Mesh(np.asarray(jax.devices()), ("dp",), axis_types=(AxisType.Explicit,))
nccl.init(mesh, blocking=False)
f = jax.jit(jax.shard_map(lambda x: comm.all_reduce(x, "dp", comm.token(), backend="nccl")[0],
                          mesh=mesh, in_specs=P("dp"), out_specs=P("dp"), check_vma=False))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("dp")), np.full((1, 4), jax.process_index() + 1.0))
y = f(x)
print("RESULT", np.asarray(y.addressable_shards[0].data).ravel().tolist())
"""


@pytest.mark.multigpu
def test_multi_process_bootstrap_through_jax_distributed(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(MULTIPROCESS_WORKER)
    port = str(20000 + os.getpid() % 10000)
    root = Path(__file__).resolve().parents[2]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(i), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=root,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": str(i), "XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
        )
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:  # a worker left running would hold its GPU for every later test
            p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out
        assert "RESULT [3.0, 3.0, 3.0, 3.0]" in out, out
