"""Does the shard loader keep up? Batches/s of the loader alone, and the data-wait share of a training loop.

1. Loader alone, GPT-124M shapes (default batch 16 x (1024 + 1) tokens, vocabulary
   50304, uint16 shards of random ids): batches/s of the grain reader (numpy, this
   process's rows) and with placement on the devices (sharded jax.Arrays).
2. Inside a training loop (`--train`): the same DDP step fed from the loader and from
   batches already in memory; data wait = 1 - time(in memory) / time(loader), plus the
   host time spent in `next()`. On a GPU use `--flavor 124m`; on CPU a small flavor.

Prints a table last and appends it to bench/RESULTS.md.

    python bench/data_loader.py [--batch 16 --seq-len 1024] [--train --flavor 124m --steps 50]
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from results import append_result  # noqa: E402

from jaxdist.train.data.prepare import FORMAT, ShardWriter, token_dtype  # noqa: E402
from jaxdist.train.data.shards import Loader, ShardData  # noqa: E402


def random_shards(directory: Path, tokens: int, vocab: int, shard_tokens: int) -> None:
    """A data directory of uniformly random token ids (what the loader reads does not matter, only how much)."""
    writer = ShardWriter(directory, "train", token_dtype(vocab), shard_tokens)
    rng = np.random.default_rng(0)
    for done in range(0, tokens, 1 << 22):
        writer.write(rng.integers(0, vocab, min(1 << 22, tokens - done), dtype=np.int64))
    index = {
        "format": FORMAT,
        "dtype": token_dtype(vocab).name,
        "vocab_size": vocab,
        "splits": {"train": writer.close()},
    }
    (directory / "index.json").write_text(json.dumps(index))


def rate(batches, n: int) -> float:
    next(batches)  # the first read starts the threads
    start = time.perf_counter()
    for _ in range(n):
        jax.block_until_ready(next(batches))
    return n / (time.perf_counter() - start)


def train_loop(args, data, sharding) -> dict:
    from flax import nnx

    from jaxdist.models.gpt import FLAVORS, GPT
    from jaxdist.train import config as config_lib
    from jaxdist.train.trainer import make_optimizer, parallelize

    mcfg = dataclasses.replace(FLAVORS[args.flavor], seq_len=args.seq_len, vocab_size=args.vocab)
    if args.bf16:
        import jax.numpy as jnp

        mcfg = dataclasses.replace(
            mcfg, dtype=jnp.bfloat16, attention="cudnn" if jax.default_backend() == "gpu" else None
        )
    cfg = config_lib.load(None, [f"data.batch_size={args.batch}", f"run.steps={args.steps}"])
    optimizer, _ = make_optimizer(cfg)
    loader = Loader(data, args.batch, sharding, threads=args.threads, prefetch=args.prefetch)
    example = {"tokens": np.zeros(loader.shape, np.int32)}
    run = parallelize(cfg, sharding.mesh, GPT(mcfg, nnx.Rngs(0)), optimizer, example)
    state = run.state
    stream = loader.batches(0)
    in_memory = [next(stream) for _ in range(4)]
    for b in in_memory[:2]:  # compile and warm up
        state, _ = run.step(state, b)
    jax.block_until_ready(state)

    def timed(next_batch):
        nonlocal state
        waited, start = 0.0, time.perf_counter()
        for step in range(args.steps):
            t = time.perf_counter()
            batch = next_batch(step)
            waited += time.perf_counter() - t
            state, _ = run.step(state, batch)
        jax.block_until_ready(state)
        return time.perf_counter() - start, waited

    t_memory, _ = timed(lambda s: in_memory[s % len(in_memory)])
    t_loader, waited = timed(lambda s: next(stream))
    return {
        "step_ms_memory": 1e3 * t_memory / args.steps,
        "step_ms_loader": 1e3 * t_loader / args.steps,
        "data_wait": max(0.0, 1 - t_memory / t_loader),
        "next_ms": 1e3 * waited / args.steps,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--tokens", type=int, default=1 << 25, help="tokens in the random data set")
    ap.add_argument("--batches", type=int, default=200, help="batches timed for the loader alone")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=4)
    ap.add_argument("--train", action="store_true", help="also time a training loop")
    ap.add_argument("--flavor", default="124m")
    ap.add_argument("--bf16", action="store_true", help="bf16 compute in the training loop (as the GPU configs)")
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("dp",), devices=devices)
    sharding = NamedSharding(mesh, P("dp"))
    with tempfile.TemporaryDirectory() as tmp:
        random_shards(Path(tmp), args.tokens, args.vocab, shard_tokens=1 << 23)
        data = ShardData(tmp, "train", args.seq_len, seed=0, stride=args.seq_len, shuffle=True)
        loader = Loader(data, args.batch, sharding, threads=args.threads, prefetch=args.prefetch)
        rows = [
            ("loader alone, numpy rows (batches/s)", rate(loader.local_batches(0), args.batches)),
            ("loader alone, placed on devices (batches/s)", rate(loader.batches(0), args.batches)),
        ]
        if args.train:
            loop = train_loop(args, data, sharding)
            rows += [
                (f"train step, batches in memory (ms), {args.flavor}", loop["step_ms_memory"]),
                (f"train step, from the loader (ms), {args.flavor}", loop["step_ms_loader"]),
                ("host time in next() per step (ms)", loop["next_ms"]),
                ("data-wait share of the loop", loop["data_wait"]),
            ]
    shape = f"{args.batch} x {args.seq_len + 1} tokens"
    table = "| measure | value |\n| --- | --- |\n" + "\n".join(f"| {name} | {v:,.3f} |" for name, v in rows)
    table += f"\n\nbatch {shape}, vocabulary {args.vocab}, {args.threads} threads, prefetch {args.prefetch}"
    print(table)
    device = f"{len(devices)} x {devices[0].device_kind}"
    append_result("Shard loader throughput (bench/data_loader.py)", " ".join(["python", *sys.argv]), device, table)


if __name__ == "__main__":
    main()
