"""Per-device memory of one train step under context parallelism, from the compiled step's
`memory_analysis()` on simulated CPU devices: the GPT at a fixed sequence length T, cp = 1, 2, 4, 8
(each data rank's sequences split over cp; cp = 1 is the unit engine on one device).

`temp` is the step's scratch memory (activations kept for backward, attention scores, gathered
keys and values, temporaries): what context parallelism divides. `arguments` holds the parameters,
optimizer state and batch, replicated over cp. Prints a table and appends it to bench/RESULTS.md
(the current one is on docs/guides/context-parallel.md).

    python bench/cp_memory.py [--seq 1024] [--rows 2] [--layers 2]
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from results import append_result  # noqa: E402

from jaxdist.engine.run import Parallel  # noqa: E402
from jaxdist.models.gpt import GPT, UNITS, GPTConfig, next_token_batch  # noqa: E402


def step_memory(cfg: GPTConfig, rows: int, cp: int):
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    batch = next_token_batch({"tokens": np.zeros((rows, cfg.seq_len + 1), np.int32)})
    run = Parallel(mesh).prepare(GPT(cfg, nnx.Rngs(0)), optax.adamw(1e-3), UNITS, batch)
    return run.step.compile(run.state, batch).memory_analysis()


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq, d_model=64, n_heads=4, n_layers=args.layers)
    mib = 2**20
    lines = [
        f"GPT d_model={cfg.d_model} heads={cfg.n_heads} layers={cfg.n_layers}, {args.rows} rows of T={args.seq}, "
        f"AdamW, float32; per device, jax {jax.__version__} CPU",
        "",
        "| cp | tokens per device | temp (MiB) | temp x cp / temp at cp=1 | arguments (MiB) |",
        "| --- | --- | --- | --- | --- |",
    ]
    base = None
    for cp in (1, 2, 4, 8):
        mem = step_memory(cfg, args.rows, cp)
        temp = mem.temp_size_in_bytes
        base = base or temp
        lines.append(
            f"| {cp} | {args.rows * args.seq // cp} | {temp / mib:.1f} | {temp * cp / base:.2f} | "
            f"{mem.argument_size_in_bytes / mib:.1f} |"
        )
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print(table)
    command = "python bench/cp_memory.py " + " ".join(sys.argv[1:])
    append_result("Context parallelism: per-device step memory", command.strip(), "8 simulated CPU devices", table)


if __name__ == "__main__":
    main()
