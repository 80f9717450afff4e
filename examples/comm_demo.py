"""A tour of jaxdist.comm: collectives with ordering tokens, sync and async.

Runs on every device JAX sees; with fewer than two, on 8 simulated CPU devices.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxdist import comm  # noqa: E402


def main() -> None:
    devices = jax.devices() if len(jax.devices()) >= 2 else jax.devices("cpu")
    n = len(devices)
    mesh = Mesh(np.asarray(devices), ("dp",), axis_types=(AxisType.Explicit,))
    print(f"{n} devices ({devices[0].platform}), mesh axis 'dp' of size {n}\n")

    def step(x):
        tok = comm.token()
        # start a gather, compute while it is in flight, then wait for it
        handle, tok = comm.all_gather_start(x, "dp", tok)
        local = jnp.tanh(x) * 2.0
        gathered, tok = comm.wait(handle, tok)
        total, tok = comm.all_reduce(local.sum(keepdims=True), "dp", tok)
        ring, tok = comm.sendrecv(x, "dp", tok, perm=[(i, (i + 1) % n) for i in range(n)])
        part, tok = comm.reduce_scatter(jnp.ones(n) * x[0], "dp", tok, op="mean")
        return gathered[None], total, ring, part

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("dp"), out_specs=(P("dp"), P("dp"), P("dp"), P("dp"))))
    x = jax.device_put(jnp.arange(float(n)), NamedSharding(mesh, P("dp")))
    gathered, total, ring, part = f(x)
    print("input (one value per device):   ", np.asarray(x))
    print("all_gather, as rank 0 sees it:  ", np.asarray(gathered)[0])
    print(
        "all_reduce of sum(2*tanh(x)):   ",
        np.asarray(total)[0].round(4),
        " numpy:",
        round(float((2 * np.tanh(np.arange(n))).sum()), 4),
    )
    print("sendrecv one step round a ring: ", np.asarray(ring))
    print("reduce_scatter(mean) of x[rank]:", np.asarray(part), " (each rank: mean of 0..n-1)")
    hlo = f.lower(x).compile().as_text()
    ops = [w for w in ("all-gather", "all-reduce", "collective-permute", "reduce-scatter") if w in hlo]
    print("\ncollectives in the compiled program:", ", ".join(ops))


if __name__ == "__main__":
    main()
