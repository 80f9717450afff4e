"""One process of the step-watchdog test: a few steps of a cross-process psum (gloo), each
under a StepWatchdog; process 1 sleeps forever inside step 3, so process 0 blocks in that
step's psum. Both must end on their own (status 3) with a report naming step 3.

Usage (env from the test): step_watchdog_script.py TIMEOUT_S OUT_DIR
"""

import sys
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.train.step_watchdog import StepWatchdog
from jaxdist.train.trainer import init_distributed


def main() -> None:
    timeout_s, out_dir = float(sys.argv[1]), sys.argv[2]
    init_distributed()
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), np.ones((1,), np.float32))
    total = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    guard = StepWatchdog(timeout_s, out_dir, process_index=jax.process_index())
    for step in range(6):
        with guard.step(step):
            if jax.process_index() == 1 and step == 3:
                time.sleep(10**6)  # a rank stuck in host code: the other waits in the psum
            x = total(x)
            x.block_until_ready()
        guard.record({"loss": float(step), "step": step})
        print(f"step {step} done", flush=True)
    guard.close()


if __name__ == "__main__":
    main()
