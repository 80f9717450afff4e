"""The nccl watchdog and flight recorder, proven on CPU against the test-double libnccl
and CUDA driver: an op whose completion never comes becomes an error within the deadline,
the communicator is aborted, and the flight record shows the op started but not completed."""

import ctypes
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jaxdist.comm import native as _native
from jaxdist.comm import watchdog

FAKE = _native.find_library(_native.FAKE_NCCL_LIBRARY)
pytestmark = pytest.mark.skipif(
    FAKE is None or not hasattr(ctypes.CDLL(str(FAKE)), "fake_cuda_stall_after"),
    reason="the compiled FFI library (with the fake CUDA driver) is not built",
)
DRIVER = Path(__file__).with_name("watchdog_driver.py")
ROOT = DRIVER.resolve().parents[2]
DEADLINE_S = 1.0


def _run_stuck_op(tmp_path, timeout_s, **env):
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "JAX_PLATFORMS": "cpu",  # also on a GPU runner: the test double stands in for the GPU
        "JAXDIST_NCCL_LIBRARY": str(FAKE),
        "JAXDIST_CUDA_DRIVER_LIBRARY": str(FAKE),
        "JAXDIST_NCCL_TIMEOUT_S": str(DEADLINE_S),
        "JAXDIST_FLIGHT_RECORD_DIR": str(tmp_path),
        **env,
    }
    out = subprocess.run(
        [sys.executable, str(DRIVER)], capture_output=True, text=True, timeout=timeout_s, env=env, cwd=tmp_path
    )
    assert out.returncode == 1, out.stderr  # a process whose watchdog tripped ends with status 1
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def stuck(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flight")
    return _run_stuck_op(tmp, timeout_s=60), tmp


def test_a_stuck_op_becomes_an_error_naming_op_axis_sequence_rank_and_step(stuck):
    r, _ = stuck
    err = r["error"]
    assert err is not None
    assert "all_gather #2 on axis 'dp'" in err and "rank 0 of 2" in err and "step 7" in err
    assert "started on the GPU and waits for a peer" in err


def test_the_watchdog_fires_within_the_deadline_plus_two_seconds(stuck):
    r, _ = stuck
    assert DEADLINE_S - 0.05 <= r["seconds"] < DEADLINE_S + 2  # t0 is taken just after the enqueue


def test_the_watchdog_aborts_the_communicator_and_fails_the_next_op(stuck):
    r, _ = stuck
    assert r["aborts"] == 1 and r["log_tail"] == "CommAbort"
    assert "all_gather #2" in r["next_op_error"] and "aborted" in r["next_op_error"]


def test_the_flight_record_file_lists_the_op_as_started_not_completed(stuck):
    r, tmp = stuck
    (path,) = tmp.glob("jaxdist-flight-record-p0-pid*.json")
    assert str(path) in r["error"]
    record = json.loads(path.read_text())
    (comm,) = record["communicators"]
    assert (comm["axis"], comm["rank"], comm["nranks"]) == ("dp", 0, 2)
    ops = [(o["seq"], o["op"], o["count"], o["dtype"], o["step"], o["state"]) for o in comm["ops"]]
    assert ops == [(1, "all_reduce", 16, "float32", -1, "completed"), (2, "all_gather", 16, "float32", 7, "started")]
    assert (comm["last_enqueued"], comm["last_completed"]) == (2, 1)
    assert record["stuck"] == {"key": comm["key"], "seq": 2}


@pytest.mark.slow  # it waits out a hang; the fast run checks that the watchdog ends the same op
def test_without_the_watchdog_the_same_op_hangs(tmp_path):
    # The switch the watchdog tests rely on: with it off nothing notices, and the
    # driver would wait forever (here: until the bounded subprocess timeout).
    with pytest.raises(subprocess.TimeoutExpired):
        _run_stuck_op(tmp_path, timeout_s=DEADLINE_S + 9, JAXDIST_NCCL_WATCHDOG="0")
    assert not list(tmp_path.glob("*.json"))


def test_missing_ranks_are_those_that_never_issued_the_stuck_op():
    progress = {
        0: [{"key": 3, "rank": 0, "last_enqueued": 9}, {"key": 4, "rank": 0, "last_enqueued": 2}],
        1: [{"key": 3, "rank": 1, "last_enqueued": 8}, {"key": 4, "rank": 1, "last_enqueued": 1}],
        2: [{"key": 3, "rank": 2, "last_enqueued": 9}],
    }
    assert watchdog.missing_ranks({"key": 3, "seq": 9}, progress) == [{"process": 1, "rank": 1, "last_enqueued": 8}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_pair(tmp, mode: str, status: int) -> list[dict]:
    """Two processes joined by jax.distributed, ranks 0 and 1 of one communicator (see the driver)."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "JAX_PLATFORMS": "cpu",
        "JAXDIST_NCCL_LIBRARY": str(FAKE),
        "JAXDIST_CUDA_DRIVER_LIBRARY": str(FAKE),
        "JAXDIST_NCCL_TIMEOUT_S": str(DEADLINE_S),
        "JAXDIST_FLIGHT_RECORD_DIR": str(tmp),
    }
    address = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(DRIVER), str(i), address, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        for i in range(2)
    ]
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == status, stderr.decode()
            outs.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    finally:
        for p in procs:
            p.kill()
    return outs


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Process 0 issues op #2, which never completes; process 1 never issues it and ends its run."""
    return _run_pair(tmp_path_factory.mktemp("pair"), "stuck", status=1)


def test_the_stuck_rank_names_the_rank_that_never_issued_the_op(pair):
    err = pair[0]["error"]
    assert "all_gather #2 on axis 'dp'" in err and "rank 0 of 2" in err
    assert "never issued by: rank 1 (process 1, last issued #1)" in err
    assert pair[0]["seconds"] < DEADLINE_S + 2


def test_the_rank_that_never_came_fails_too_with_the_same_story(pair):
    err = pair[1]["error"]
    assert "process 0 failed" in err and "all_gather #2" in err and "never issued by: rank 1" in err
    assert pair[1]["seconds"] < DEADLINE_S + 5
    assert pair[1]["aborts"] == 1  # its communicator is aborted rather than finalized against a stuck peer


def test_a_run_whose_ranks_issue_the_same_ops_ends_cleanly_with_no_record(tmp_path):
    outs = _run_pair(tmp_path, "healthy", status=0)
    assert [o["error"] for o in outs] == [None, None]
    assert [o["log_tail"] for o in outs] == ["CommDestroy", "CommDestroy"]  # finalized, not aborted
    assert not list(tmp_path.glob("*.json"))


def test_ranks_that_completed_different_numbers_of_ops_fail_at_the_end_of_the_run(tmp_path):
    outs = _run_pair(tmp_path, "mismatch", status=1)
    for o in outs:
        assert (
            "the ranks of axis 'dp' issued different numbers of ops (rank 0 (process 0): 2, rank 1 (process 1): 1)"
            in o["error"]
        )
