"""Runs jaxdist's NCCL call protocol against the recording test-double libnccl.

Run as a subprocess (a process can load only one libnccl): prints one JSON
object with, per scenario, the fake's call log, the error text (if any), the
seconds taken and the number of aborts.
"""

import ctypes
import json
import os
import sys
import threading
import time

from jaxdist.comm import native as _native
from jaxdist.comm.nccl import _POLL_MODES as POLL_MODES

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, SENDRECV = 0, 1, 2, 3
NCCL_INTERNAL_ERROR = 3
NCCL_IN_PROGRESS = 7


def poll_counts(lib) -> dict:
    out = (ctypes.c_int64 * 2)()
    lib.jaxdist_poll_counts(out)
    return {"yields": out[0], "sleeps": out[1]}


def main() -> None:
    fake_path = sys.argv[1]
    fake = ctypes.CDLL(fake_path)
    fake.fake_nccl_log.restype = ctypes.c_char_p
    lib = _native.ffi_library()
    _native.call("jaxdist_nccl_load", fake_path.encode())
    results = {}

    def scenario(name, fn, *, in_progress=0, fail=None, timeout_ms=300000):
        fake.fake_nccl_reset()
        lib.jaxdist_set_timeout_ms(timeout_ms)
        fake.fake_nccl_set_in_progress(in_progress)
        if fail:
            fake.fake_nccl_fail_next(fail[0].encode(), fail[1], fail[2].encode())
        t0 = time.perf_counter()
        try:
            fn()
            err = None
        except RuntimeError as e:
            err = str(e)
        results[name] = dict(
            log=fake.fake_nccl_log().decode().splitlines(),
            error=err,
            seconds=time.perf_counter() - t0,
            aborts=fake.fake_nccl_aborts(),
        )

    ids = (b"\x07" * lib.jaxdist_unique_id_bytes()) * 2
    ints = lambda *xs: (ctypes.c_int * len(xs))(*xs)  # noqa: E731
    keys = iter(range(100, 200))

    # Negative device ordinals: no CUDA device is touched (the fake needs none),
    # so these tests also run on a GPU runner with fewer GPUs than ranks.
    def init(key, blocking, n=1):
        _native.call(
            "jaxdist_comm_init",
            key,
            n,
            ids[: 128 * n],
            ints(*[2] * n),
            ints(*range(n)),
            ints(*range(-1, -n - 1, -1)),
            blocking,
            b"dp",
        )

    def issue(key, kind, send_peer=-1, recv_peer=-1):
        _native.call("jaxdist_test_issue", key, -1, kind, 16, send_peer, recv_peer)

    def issue_on(key, device):
        _native.call("jaxdist_test_issue", key, device, ALL_REDUCE, 16, -1, -1)

    def run_on_new_comm(kind, blocking, **peers):
        fake.fake_nccl_reset()
        lib.jaxdist_set_timeout_ms(300000)
        key = next(keys)
        init(key, blocking)
        _native.call("jaxdist_comm_wait_ready", key)
        return lambda: issue(key, kind, **peers)

    def run_group_on_new_comm(kind, blocking, n):
        fake.fake_nccl_reset()
        lib.jaxdist_set_timeout_ms(300000)
        key = next(keys)
        init(key, blocking)
        _native.call("jaxdist_comm_wait_ready", key)
        return lambda: _native.call("jaxdist_test_issue_group", key, -1, kind, 16, n)

    for blocking in (1, 0):
        mode = "blocking" if blocking else "nonblocking"
        key = next(keys)
        scenario(
            f"init_{mode}",
            lambda key=key, b=blocking: (init(key, b, n=2), _native.call("jaxdist_comm_wait_ready", key)),
        )
        scenario(f"send_only_{mode}", run_on_new_comm(SENDRECV, blocking, send_peer=1))
        scenario(f"recv_only_{mode}", run_on_new_comm(SENDRECV, blocking, recv_peer=1))
        scenario(f"sendrecv_{mode}", run_on_new_comm(SENDRECV, blocking, send_peer=1, recv_peer=1))
        scenario(f"all_reduce_{mode}", run_on_new_comm(ALL_REDUCE, blocking))
        for name, kind in (("all_reduce", ALL_REDUCE), ("reduce_scatter", REDUCE_SCATTER), ("all_gather", ALL_GATHER)):
            scenario(f"group3_{name}_{mode}", run_group_on_new_comm(kind, blocking, 3))
    scenario("in_progress_5_times", run_on_new_comm(SENDRECV, 0, send_peer=1), in_progress=5)
    scenario(
        "blocking_in_progress_3_times",
        run_on_new_comm(ALL_REDUCE, 1),
        in_progress=3,
        fail=("GroupEnd", NCCL_IN_PROGRESS, ""),
    )
    scenario("stuck_in_progress", run_on_new_comm(ALL_GATHER, 0), in_progress=-1, timeout_ms=300)
    scenario(
        "error_from_call",
        run_on_new_comm(REDUCE_SCATTER, 1),
        fail=("ReduceScatter", NCCL_INTERNAL_ERROR, "peer 1 vanished"),
    )
    scenario(
        "error_in_group",
        run_group_on_new_comm(ALL_REDUCE, 1, 3),
        fail=("AllReduce", NCCL_INTERNAL_ERROR, "peer 1 vanished"),
    )
    scenario(
        "async_error",
        run_on_new_comm(ALL_REDUCE, 0),
        fail=("CommGetAsyncError", NCCL_INTERNAL_ERROR, "remote rank failed"),
    )
    for blocking in (1, 0):
        results[f"pipeline_{'blocking' if blocking else 'nonblocking'}"] = pipeline_ticks(next(keys), blocking)
    key = next(keys)
    init(key, 1)
    scenario("destroy", lambda: _native.call("jaxdist_comm_destroy", key))

    # How the wait spends an op that stays in progress for a few polls, per poll mode.
    for mode, n in (("yield", 20), ("local", 5), ("local", 20)):
        op = run_on_new_comm(ALL_REDUCE, 0)
        lib.jaxdist_set_poll_mode(POLL_MODES[mode])
        lib.jaxdist_poll_counts_reset()
        scenario(f"poll_{mode}_{n}_in_progress", op, in_progress=n)
        results[f"poll_{mode}_{n}_in_progress"]["counts"] = poll_counts(lib)
    lib.jaxdist_set_poll_mode(POLL_MODES["local"])

    # NCCL's own thread per non-blocking group end, started where the issuing thread may run.
    fake.fake_nccl_set_group_threads.argtypes = [ctypes.c_int]
    for mode in ("yield", "local"):
        op = run_on_new_comm(ALL_REDUCE, 0)
        fake.fake_nccl_set_group_threads(1)
        lib.jaxdist_set_poll_mode(POLL_MODES[mode])
        before = sorted(os.sched_getaffinity(0))
        op()
        results[f"group_thread_{mode}"] = {
            "thread_cpus": fake.fake_nccl_group_thread_cpus(),
            "caller_cpus_before": before,
            "caller_cpus_after": sorted(os.sched_getaffinity(0)),
            "log": fake.fake_nccl_log().decode().splitlines(),
        }
    lib.jaxdist_set_poll_mode(POLL_MODES["local"])

    # Two devices' communicators polled at once: one held inside ncclCommGetAsyncError
    # (as NCCL joining its group thread) must not hold up the other.
    fake.fake_nccl_reset()
    key = next(keys)
    init(key, 0, n=2)
    _native.call("jaxdist_comm_wait_ready", key)
    fake.fake_nccl_gate(0)
    held = threading.Thread(target=issue_on, args=(key, -1), daemon=True)
    held.start()
    deadline = time.monotonic() + 30
    while not fake.fake_nccl_gate_entered() and time.monotonic() < deadline:
        time.sleep(0.001)
    other = threading.Thread(target=issue_on, args=(key, -2), daemon=True)
    t0 = time.perf_counter()
    other.start()
    other.join(10)
    results["independent_polls"] = {
        "held_entered": bool(fake.fake_nccl_gate_entered()),
        "other_finished_while_held": not other.is_alive(),
        "other_seconds": time.perf_counter() - t0,
    }
    fake.fake_nccl_gate(-1)
    held.join(10)
    other.join(10)
    results["independent_polls"]["both_finished"] = not held.is_alive() and not other.is_alive()
    print(json.dumps(results))


def pipeline_ticks(key: int, blocking: int) -> dict:
    """A 1F1B table over pp=4 ranks of one communicator, issued tick by tick as the pipeline step's
    `comm.sendrecv(x, "pp", perm=tick.perm())` issues it: each rank's peers picked from the perm as
    the FFI handler picks them (the pair whose src is the rank: its send peer; whose dst: its receive
    peer). Returns, per tick and rank, the fake's call log of that rank's op."""
    from jaxdist.pipeline.schedule import one_f_one_b

    lib = _native.ffi_library()
    fake = ctypes.CDLL(sys.argv[1])
    fake.fake_nccl_log.restype = ctypes.c_char_p
    pp = 4
    ids = b"\x09" * lib.jaxdist_unique_id_bytes() * pp
    ints = lambda *xs: (ctypes.c_int * len(xs))(*xs)  # noqa: E731
    devices = list(range(-1, -pp - 1, -1))
    _native.call("jaxdist_comm_init", key, pp, ids, ints(*[pp] * pp), ints(*range(pp)), ints(*devices), blocking, b"pp")
    _native.call("jaxdist_comm_wait_ready", key)
    table = one_f_one_b(pp, 4)
    out = []
    for tick in table.ticks:
        perm = tick.perm()
        per_rank = {}
        for rank in range(pp):
            send = next((d for s, d in perm if s == rank), -1)
            recv = next((s for s, d in perm if d == rank), -1)
            if send < 0 and recv < 0:
                continue
            fake.fake_nccl_reset()
            _native.call("jaxdist_test_issue", key, devices[rank], SENDRECV, 16, send, recv)
            per_rank[rank] = fake.fake_nccl_log().decode().splitlines()
        out.append(per_rank)
    return {"ticks": out, "perms": [list(map(list, t.perm())) for t in table.ticks]}


if __name__ == "__main__":
    main()
