"""The NCCL call protocol, proven on CPU against a recording test-double libnccl.

Every point-to-point op sits inside its own ncclGroupStart/End (docs/design.md, the third failure);
every call that may answer ncclInProgress is polled until it stops; a state
stuck in progress hits the deadline, aborts and raises; NCCL errors become
exceptions carrying NCCL's message.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxdist.comm import native as _native

FAKE = _native.find_library(_native.FAKE_NCCL_LIBRARY)
pytestmark = pytest.mark.skipif(FAKE is None, reason="the compiled FFI library is not built")
DRIVER = Path(__file__).with_name("nccl_protocol_driver.py")


@pytest.fixture(scope="module")
def runs():
    out = subprocess.run(
        [sys.executable, str(DRIVER), str(FAKE)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=DRIVER.resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _after_group(log):
    """The call lines from GroupEnd on."""
    return log[log.index("GroupEnd") :]


@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
@pytest.mark.parametrize(
    "op,calls",
    [
        ("send_only", ["Send peer=1 count=16"]),
        ("recv_only", ["Recv peer=1 count=16"]),
        ("sendrecv", ["Send peer=1 count=16", "Recv peer=1 count=16"]),
        ("all_reduce", ["AllReduce count=16 op=0"]),
    ],
)
def test_each_op_is_issued_inside_its_own_group_then_polled(runs, op, calls, mode):
    log = runs[f"{op}_{mode}"]["log"]
    # a non-blocking communicator is polled even after ncclSuccess (docs/design.md, the third failure);
    # a blocking one has finished when the call returns ncclSuccess
    poll = ["CommGetAsyncError -> Success"] if mode == "nonblocking" else []
    assert log == ["GroupStart", *calls, "GroupEnd", *poll]


@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
@pytest.mark.parametrize(
    "op,call",
    [
        ("all_reduce", "AllReduce count=16 op=0"),
        ("reduce_scatter", "ReduceScatter count=16 op=0"),
        ("all_gather", "AllGather count=16"),
    ],
)
def test_a_group_of_collectives_is_one_nccl_group_then_polled_once(runs, op, call, mode):
    """A bucket's collectives over its parameters in place (`jaxdist.comm` ops on a tuple of arrays):
    every call inside one group, one launch, then the one poll of a single op."""
    log = runs[f"group3_{op}_{mode}"]["log"]
    poll = ["CommGetAsyncError -> Success"] if mode == "nonblocking" else []
    assert runs[f"group3_{op}_{mode}"]["error"] is None
    assert log == ["GroupStart", call, call, call, "GroupEnd", *poll]


@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
def test_each_pipeline_tick_of_a_rank_is_one_group_lone_sends_and_receives_too(runs, mode):
    """A 1F1B table (pp=4, 4 micro-batches) issued tick by tick: every rank that communicates in a
    tick issues its send and its receive in one group; a warm-up tick's lone send and a cool-down
    tick's lone receive are grouped as well (docs/design.md, the third failure)."""
    ticks = runs[f"pipeline_{mode}"]["ticks"]
    poll = ["CommGetAsyncError -> Success"] if mode == "nonblocking" else []
    kinds = set()
    for t, per_rank in enumerate(ticks):
        for rank, log in per_rank.items():
            calls = log[1 : log.index("GroupEnd")]
            assert log == ["GroupStart", *calls, "GroupEnd", *poll], (t, rank, log)
            assert 1 <= len(calls) <= 2 and all(c.split()[0] in ("Send", "Recv") for c in calls), (t, rank)
            kinds.add(tuple(c.split()[0] for c in calls))
    assert ticks[0] == {
        "0": ["GroupStart", "Send peer=1 count=16", "GroupEnd", *poll],
        "1": ["GroupStart", "Recv peer=0 count=16", "GroupEnd", *poll],
    }  # warm-up
    assert ticks[-2] == {
        "1": ["GroupStart", "Send peer=0 count=16", "GroupEnd", *poll],
        "0": ["GroupStart", "Recv peer=1 count=16", "GroupEnd", *poll],
    }  # cool-down
    assert kinds == {("Send",), ("Recv",), ("Send", "Recv")}


@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
def test_init_of_several_local_ranks_is_grouped_and_polled(runs, mode):
    log = runs[f"init_{mode}"]["log"]
    b = int(mode == "blocking")
    assert log[:4] == [
        "GroupStart",
        f"CommInitRankConfig rank=0 nranks=2 blocking={b}",
        f"CommInitRankConfig rank=1 nranks=2 blocking={b}",
        "GroupEnd",
    ]
    assert log[4:] == ([] if b else ["CommGetAsyncError -> Success"] * 2)


def test_in_progress_answered_five_times_is_polled_until_success(runs):
    log = _after_group(runs["in_progress_5_times"]["log"])
    assert log == ["GroupEnd"] + ["CommGetAsyncError -> InProgress"] * 5 + ["CommGetAsyncError -> Success"]
    assert runs["in_progress_5_times"]["error"] is None


def test_a_blocking_call_that_answers_in_progress_is_polled_too(runs):
    log = _after_group(runs["blocking_in_progress_3_times"]["log"])
    assert log[-4:] == ["CommGetAsyncError -> InProgress"] * 3 + ["CommGetAsyncError -> Success"]
    assert runs["blocking_in_progress_3_times"]["error"] is None


def test_stuck_in_progress_hits_the_deadline_aborts_and_raises(runs):
    r = runs["stuck_in_progress"]
    assert "all_gather" in r["error"] and "axis 'dp'" in r["error"] and "rank 0 of 2" in r["error"]
    assert "300 ms deadline" in r["error"]
    assert r["log"][-1] == "CommAbort" and r["aborts"] == 1
    assert 0.3 <= r["seconds"] < 0.3 + 0.5  # the 300 ms deadline plus a small margin


def test_an_nccl_error_becomes_an_exception_with_nccls_message(runs):
    r = runs["error_from_call"]
    assert "reduce_scatter" in r["error"] and "internal error" in r["error"] and "peer 1 vanished" in r["error"]
    assert r["log"][-2:] == ["GroupEnd", "CommAbort"]  # the group is closed before aborting


def test_an_nccl_error_inside_a_group_closes_the_group_aborts_and_raises(runs):
    """The first of a group's three calls fails: the rest are not issued, the group is closed (NCCL's
    group state stays balanced), the communicator aborted, and NCCL's message raised."""
    r = runs["error_in_group"]
    assert "all_reduce" in r["error"] and "internal error" in r["error"] and "peer 1 vanished" in r["error"]
    assert r["log"][0] == "GroupStart" and r["log"][-2:] == ["GroupEnd", "CommAbort"]
    assert r["log"][1:3] == ["AllReduce count=16 op=0", "AllReduce -> error"]  # the one call, failed
    assert sum(line.startswith("AllReduce count") for line in r["log"]) == 1
    assert r["aborts"] == 1


def test_an_async_error_found_while_polling_is_raised(runs):
    r = runs["async_error"]
    assert "remote rank failed" in r["error"] and r["log"][-1] == "CommAbort"


def test_destroy_finalizes_then_destroys(runs):
    assert runs["destroy"]["log"] == ["CommFinalize", "CommDestroy"]


def test_nccl_is_loaded_from_the_path_in_the_env_var():
    code = (
        "from jaxdist.comm import nccl; import jaxdist.comm.native as n; print(nccl.nccl_library_path()); "
        "n.call('jaxdist_nccl_load', str(nccl.nccl_library_path()).encode()); "
        "print(n.ffi_library().jaxdist_nccl_version())"
    )
    env = {**os.environ, "JAXDIST_NCCL_LIBRARY": str(FAKE)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(FAKE), "99999"]  # the fake's version number


def test_a_missing_nccl_library_gives_a_clear_error(monkeypatch):
    from jaxdist.comm import nccl

    monkeypatch.setenv("JAXDIST_NCCL_LIBRARY", "/nowhere/libnccl.so.2")
    nccl.load.cache_clear()
    with pytest.raises(_native.NativeLibraryError, match="cannot load NCCL from /nowhere/libnccl.so.2"):
        nccl.load()
    nccl.load.cache_clear()


def test_the_nccl_backend_without_gpus_says_to_use_xla():
    import jax
    import jax.numpy as jnp
    from support.meshes import cpu_mesh

    from jaxdist import comm

    if jax.devices()[0].platform == "gpu":
        pytest.skip("this machine has GPUs")
    mesh = cpu_mesh((8,), ("x",))
    f = jax.shard_map(
        lambda x: comm.all_reduce(x, "x", comm.token(), backend="nccl")[0],
        mesh=mesh,
        in_specs=jax.P("x"),
        out_specs=jax.P("x"),
    )
    with pytest.raises(RuntimeError, match="needs CUDA GPUs.*backend='xla'"):
        jax.jit(f).lower(jax.ShapeDtypeStruct((8,), jnp.float32, sharding=jax.NamedSharding(mesh, jax.P("x"))))


# A poll that finds the op still in progress after 500 us sleeps instead (with back-off): on a
# loaded machine a yield can give the CPU away that long, so the tests count yields and sleeps
# together where the clock decides between them.


def test_local_poll_mode_busy_polls_a_short_wait_then_yields(runs):
    # the first 8 in-progress answers are busy-polled (no yield); later ones yield the CPU, where
    # NCCL's group thread waits to run
    short, longer = runs["poll_local_5_in_progress"], runs["poll_local_20_in_progress"]
    assert short["error"] is None and longer["error"] is None
    assert short["log"].count("CommGetAsyncError -> InProgress") == 5
    assert short["counts"]["yields"] == 0
    assert longer["counts"]["yields"] + longer["counts"]["sleeps"] == 20 - 8
    assert longer["counts"]["yields"] >= 1


def test_yield_poll_mode_yields_between_polls(runs):
    r = runs["poll_yield_20_in_progress"]
    assert r["error"] is None
    assert r["counts"]["yields"] + r["counts"]["sleeps"] == 20 and r["counts"]["yields"] >= 1


def test_local_poll_mode_starts_nccls_group_thread_on_the_issuing_cpu(runs):
    # NCCL starts a thread per non-blocking group end; started on an idle core it waits
    # for that core to wake (70-89 us per op), started here it runs as we yield
    local, other = runs["group_thread_local"], runs["group_thread_yield"]
    assert local["log"][-2:] == ["GroupEnd", "CommGetAsyncError -> Success"]  # polled until NCCL's thread is done
    assert local["thread_cpus"] == 1
    assert local["caller_cpus_after"] == local["caller_cpus_before"]  # the caller's affinity is restored
    assert other["thread_cpus"] == len(other["caller_cpus_before"])  # the other modes leave it alone


def test_a_poll_held_inside_nccl_does_not_hold_up_another_devices_communicator(runs):
    # one process driving two GPUs polls both communicators from two threads; a poll can
    # sit inside ncclCommGetAsyncError (joining NCCL's group thread): the other goes on
    r = runs["independent_polls"]
    assert r["held_entered"]
    assert r["other_finished_while_held"], "the second communicator waited for the first one's poll"
    assert r["both_finished"]


def test_an_ffi_library_older_than_the_python_side_gives_a_clear_error():
    # a library that lacks entry points (here: the fake libnccl, which has none) says to rebuild
    code = "import jaxdist.comm.native as n; n.ffi_library()"
    env = {**os.environ, "JAXDIST_FFI_LIBRARY": str(FAKE)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert "NativeLibraryError" in last and "is older than this jaxdist" in last and "rebuild it" in last
