"""One process of the watchdog tests: an op on a test-double communicator whose
completion never comes (the fake CUDA driver holds its "finished" event forever).

Run as a subprocess with $JAXDIST_NCCL_LIBRARY and $JAXDIST_CUDA_DRIVER_LIBRARY
pointing at the test double and a short $JAXDIST_NCCL_TIMEOUT_S. Waits in Python
(as a training loop blocked on a result would) until the watchdog's exception
arrives, then prints one JSON object: the error, the seconds from the enqueue to
the error, the aborts the double saw, and the error of the next op. Without a
watchdog it waits forever: the test's subprocess timeout bounds it.

`watchdog_driver.py PROCESS COORDINATOR` is one of two processes joined by
jax.distributed, ranks 0 and 1 of one communicator: both issue op #1, process 0
alone issues op #2 (which never completes: process 1 is the rank that never
came), and process 1 ends its run with nccl.shutdown(). A third argument
changes the story: `healthy` (both issue both ops, nothing stalls) or
`mismatch` (only process 0 issues op #2, and it completes).
"""

import ctypes
import json
import os
import sys
import time

from jaxdist.comm import native as _native
from jaxdist.comm import nccl

ALL_REDUCE, ALL_GATHER = 0, 1


def main(process: int, coordinator: str | None, mode: str) -> None:
    if coordinator:
        import jax

        jax.distributed.initialize(coordinator, 2, process)
    fake = ctypes.CDLL(os.environ["JAXDIST_NCCL_LIBRARY"])
    fake.fake_nccl_log.restype = ctypes.c_char_p
    nccl.load()
    n_id = _native.ffi_library().jaxdist_unique_id_bytes()
    ints = lambda *xs: (ctypes.c_int * len(xs))(*xs)  # noqa: E731
    # rank `process` of 2 on no real device (-1): the double needs none
    _native.call("jaxdist_comm_init", 1, 1, b"\x07" * n_id, ints(2), ints(process), ints(-1), 1, b"dp")
    nccl._registry[("test double",)] = 1  # so that nccl.shutdown() ends it like one of its own
    # op #1 completes; op #2's "started" event completes, its "finished" event never does
    fake.fake_cuda_stall_after(3 if mode == "stuck" else -1)
    _native.call("jaxdist_test_issue", 1, -1, ALL_REDUCE, 16, -1, -1)
    nccl.watchdog.set_step(7)
    out = {"error": None}
    t0 = time.monotonic()
    try:
        if process == 0 and mode == "stuck":
            _native.call("jaxdist_test_issue", 1, -1, ALL_GATHER, 16, -1, -1)
            t0 = time.monotonic()
            while True:
                time.sleep(0.01)
        else:
            if process == 0 or mode == "healthy":
                _native.call("jaxdist_test_issue", 1, -1, ALL_GATHER, 16, -1, -1)
            time.sleep(0.5)  # let process 0 publish its progress first
            nccl.shutdown()  # the end of this rank's run
    except nccl.NcclTimeoutError as e:
        out["error"] = str(e)
        out["seconds"] = time.monotonic() - t0
    out["aborts"] = fake.fake_nccl_aborts()
    out["log_tail"] = fake.fake_nccl_log().decode().splitlines()[-1]
    if out["error"]:
        try:
            _native.call("jaxdist_test_issue", 1, -1, ALL_REDUCE, 16, -1, -1)
            out["next_op_error"] = None
        except RuntimeError as e:
            out["next_op_error"] = str(e)
    print(json.dumps(out), flush=True)
    nccl.shutdown()


if __name__ == "__main__":
    args = sys.argv[1:] + [None] * 3
    main(int(args[0] or 0), args[1], args[2] or "stuck")
