"""jaxdist's token tie against JAX's `control_deps`: does each order a chain of collectives, and at what cost?

On 8 simulated CPU devices, a `shard_map` body issues N all-gathers, each followed by a matmul
on its result, in the reverse of the parameters' order, ordered one after the other either by a
jaxdist token chain (`comm.all_gather`) or by `jax.experimental.control_deps.control_dep` between
consecutive `lax.all_gather`s. Prints,
for each variant: whether the compiled schedule keeps the collectives in program order, the
compiled step's temp memory, and the median step time.

python bench/sequencing_ab.py [--n 16] [--size 256] [--reps 20]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxdist import comm  # noqa: E402

# Each variant gathers the inputs in reverse: an order XLA's scheduler would not pick by itself
# (it keeps parameter order when nothing says otherwise), so the schedule shows whether it held.


def chain_tokens(xs, n):
    tok = comm.token()
    acc = []
    for i in reversed(range(n)):
        g, tok = comm.all_gather(xs[i], "dp", tok)
        acc.append(jnp.tanh(g @ g.T).sum())
    return jnp.stack(acc)


def chain_control_deps(xs, n):
    from jax.experimental.control_deps import control_dep

    acc, prev = [], None
    for i in reversed(range(n)):
        g = jax.lax.all_gather(xs[i], "dp", tiled=True)
        if prev is not None:
            control_dep(prev, g)
        prev = g
        acc.append(jnp.tanh(g @ g.T).sum())
    return jnp.stack(acc)


def chain_none(xs, n):
    gathered = [jax.lax.all_gather(xs[i], "dp", tiled=True) for i in reversed(range(n))]
    return jnp.stack([jnp.tanh(g @ g.T).sum() for g in gathered])


def gathers_in_program_order(text: str) -> bool:
    """Whether the entry computation's all-gathers run in the order the program issues them (the
    parameters' reverse order)."""
    entry = text[text.index("ENTRY") :]
    params = {name: int(k) for name, k in re.findall(r"%(\S+) = [^\n]*parameter\((\d+)\)", entry)}
    order = []
    for line in entry.splitlines():
        if " all-gather(" in line or "all-gather-start(" in line:
            operand = re.search(r"all-gather(?:-start)?\(([^)]*)\)", line).group(1).split(",")[0].strip().lstrip("%")
            order.append(params.get(operand, -1))
    return bool(order) and order == sorted(order, reverse=True)


def measure(body, n, size, reps):
    mesh = jax.make_mesh((8,), ("dp",))
    f = jax.jit(
        jax.shard_map(lambda *xs: body(xs, n), mesh=mesh, in_specs=(P("dp"),) * n, out_specs=P(), check_vma=False)
    )
    sharding = jax.sharding.NamedSharding(mesh, P("dp"))
    xs = [jax.device_put(jnp.full((size, size), float(i + 1)) / size, sharding) for i in range(n)]
    compiled = f.lower(*xs).compile()
    in_order = gathers_in_program_order(compiled.as_text())
    jax.block_until_ready(f(*xs))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*xs))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, compiled.memory_analysis().temp_size_in_bytes, in_order


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    rows = []
    for name, body in (("none", chain_none), ("jaxdist tokens", chain_tokens), ("control_deps", chain_control_deps)):
        rows.append((name, *measure(body, a.n, a.size, a.reps)))
    base = rows[0][1]
    print(f"{a.n} all-gathers of ({a.size // 8}, {a.size}) per device, 8 CPU devices, jax {jax.__version__}")
    print(f"{'ordering':16s} {'ms/step':>9s} {'vs none':>8s} {'temp MiB':>9s}  gathers in program order")
    for name, ms, temp, in_order in rows:
        print(f"{name:16s} {ms:9.2f} {ms / base:8.2f} {temp / 2**20:9.2f}  {in_order}")


if __name__ == "__main__":
    main()
