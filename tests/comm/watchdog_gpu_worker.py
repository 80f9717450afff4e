"""One of two GPU processes for the watchdog's multi-GPU tests: STEPS steps of one nccl
all_reduce each, then nccl.shutdown(). Process 1 skips the all_reduce of step SKIP
(-1: none), so process 0's last all_reduce never finds its partner.

Usage: watchdog_gpu_worker.py PROCESS PORT STEPS SKIP
"""

import json
import sys

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

process, port, steps, skip = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
jax.distributed.initialize("localhost:" + port, num_processes=2, process_id=process)

from jaxdist import comm  # noqa: E402
from jaxdist.comm import nccl, watchdog  # noqa: E402

mesh = Mesh(np.asarray(jax.devices()), ("dp",), axis_types=(AxisType.Explicit,))
nccl.init(mesh)
f = jax.jit(
    jax.shard_map(
        lambda x: comm.all_reduce(x, "dp", comm.token(), backend="nccl")[0],
        mesh=mesh,
        in_specs=P("dp"),
        out_specs=P("dp"),
        check_vma=False,
    )
)
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("dp")), np.ones((1, 1024), np.float32))
for step in range(steps):
    watchdog.set_step(step)
    if process == 1 and step == skip:
        print(f"skipping the all_reduce of step {step}", flush=True)
        continue
    x = f(x) / 2
    x.block_until_ready()
record = nccl.flight_record(ops=False)
print("PROGRESS", json.dumps([(c["last_enqueued"], c["last_completed"]) for c in record["communicators"]]), flush=True)
nccl.shutdown()
print("CLEAN END", flush=True)
