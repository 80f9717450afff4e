"""Does a pipelined step's time follow the schedule's bubble, (p - 1) / (m + p - 1) for 1F1B?

Method (overhead and per-tick cost separated without assuming the formula): a fixed
micro-batch size; m in {4, 8, 16} micro-batches (multiples of pp); each m under 1F1B and under
interleaved 1F1B with v = 2 (the same model, pp and per-step overhead: optimizer, stage-weight
all-to-all, data-axis reduction); the median wall time of `--steps` steps after 2 warm-up steps.
The model of a tick-synchronous table: T = c + N * (tau / v + delta), with N the table's tick
count, tau a stage's work for one micro-batch pass (a chunk of the interleaved schedule is half
a stage), delta the fixed cost of a tick (its send/recv, launches) and c the step's overhead.
Least squares over the six points gives c, tau, delta; the fit's residuals say whether the step
follows the tables. The measured bubble at m is the share of the pipelined time T - c that is
not a rank's own 2 v m work ticks: 1 - 2 v m (tau / v + delta) / (T - c), to set against
(p - 1) / (v m + p - 1). The two schedules' different tick counts are what separate c from
the bubble; one schedule alone cannot.

CPU: the simulated devices must run concurrently for a bubble to show (a rank waiting while
another computes): give each pp rank its own core (an idle machine with >= pp cores). On the
shared 2-core machine the ranks are serialized, the step time is the sum of all ranks' work, and
no bubble shows (the fit says so: large residuals or a bubble near 0). On GPUs (one per rank)
the method applies as is.

python bench/pipeline_bubble.py --pp 4 --width 512 --rows 64
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.results import append_result  # noqa: E402
from jaxdist.engine.run import Units  # noqa: E402
from jaxdist.pipeline import schedule as ps  # noqa: E402
from jaxdist.pipeline.run import Pipelined  # noqa: E402


class Block(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.up, self.down = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


class MLP(nnx.Module):
    def __init__(self, d: int, layers: int, rngs: nnx.Rngs):
        self.inp, self.out = nnx.Linear(d, d, rngs=rngs), nnx.Linear(d, d, rngs=rngs)
        self.layers = nnx.List([Block(d, rngs) for _ in range(layers)])


UNITS = Units(
    embed=lambda m, b: m.inp(b["x"]), head_loss=lambda m, x, b: ((m.out(x) - b["y"]) ** 2).mean(), blocks="layers"
)


def step_time(pp: int, m: int, schedule: str, virtual: int, args) -> float:
    devices = jax.devices()[:pp]
    mesh = jax.make_mesh((pp,), ("pp",), devices=devices)
    rng = np.random.default_rng(0)
    n = args.rows * m
    batch = {"x": rng.normal(size=(n, args.width)).astype(np.float32)}
    batch["y"] = rng.normal(size=(n, args.width)).astype(np.float32)
    run = Pipelined(mesh, microbatches=m, schedule=schedule, virtual=virtual).prepare(
        MLP(args.width, pp * args.blocks_per_stage, nnx.Rngs(0)), optax.sgd(1e-3), UNITS, batch
    )
    state, times = run.state, []
    for i in range(args.steps + 2):
        t0 = time.perf_counter()
        state, metrics = run.step(state, batch)
        jax.block_until_ready(metrics["loss"])
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rows", type=int, default=32, help="rows per micro-batch")
    parser.add_argument("--blocks-per-stage", type=int, default=2, help="even: interleaved halves a stage")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ms", default="4,8,16", help="micro-batch counts, multiples of pp")
    parser.add_argument("--record", action="store_true", help="append the table to bench/RESULTS.md")
    args = parser.parse_args()
    ms = [int(x) for x in args.ms.split(",")]
    p = args.pp
    points = []  # (schedule, v, m, ticks, seconds)
    for name, v in (("1f1b", 1), ("interleaved", 2)):
        for m in ms:
            ticks = len(ps.make(name, p, m, v).ticks)
            points.append((name, v, m, ticks, step_time(p, m, name, v, args)))
    a = np.asarray([[1.0, n / v, n] for _, v, _, n, _ in points])
    y = np.asarray([s for *_, s in points])
    (overhead, tau, delta), *_ = np.linalg.lstsq(a, y, rcond=None)
    rows = [
        "| schedule | m | ticks | step ms | fit ms | bubble, formula | bubble, measured | measured / formula |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, v, m, ticks, sec in points:
        formula = (p - 1) / (v * m + p - 1)
        measured = 1 - 2 * v * m * (tau / v + delta) / (sec - overhead)
        fit = overhead + ticks * (tau / v + delta)
        rows.append(
            f"| {name} | {m} | {ticks} | {sec * 1e3:.1f} | {fit * 1e3:.1f} | {formula:.3f} | {measured:.3f} "
            f"| {measured / formula:.2f} |"
        )
    rows.append(
        f"\nfit: step overhead c = {overhead * 1e3:.2f} ms, stage work tau = {tau * 1e3:.2f} ms per micro-batch pass, "
        f"tick cost delta = {delta * 1e3:.2f} ms"
    )
    table = "\n".join(rows)
    print(table)
    if args.record:
        device = f"{jax.devices()[0].device_kind} x {p}"
        append_result(f"Pipeline bubble, pp={p}", " ".join(sys.argv), device, table)


if __name__ == "__main__":
    main()
