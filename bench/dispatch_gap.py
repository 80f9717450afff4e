"""Does the one-GPU step lose time between steps? The same train step called once per step against K
steps inside one jitted `lax.scan` (one dispatch per K steps), on a GPT flavor.

    python bench/dispatch_gap.py 350m 16 loop      # one jitted step per call, state donated
    python bench/dispatch_gap.py 350m 16 scan      # 4 steps per call

Prints one JSON line: ms/step (the median of three windows of 12 steps), MFU on 989 TFLOP/s, the host's
time in each call per step, the device's peak GiB. If the device waited for the host's next dispatch,
the scan's ms/step would be lower than the loop's by that wait.
"""

import dataclasses
import json
import os
import statistics
import sys
import time

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxdist.models import families  # noqa: E402
from jaxdist.models.gpt import FLAVORS, GPT, next_token_loss  # noqa: E402

STEPS_PER_SCAN = 4


def main(flavor: str, batch_size: int, mode: str) -> None:
    gpu = jax.default_backend() == "gpu"
    cfg = dataclasses.replace(FLAVORS[flavor], dtype=jnp.bfloat16, attention="cudnn" if gpu else None)
    with jax.default_device(jax.devices("cpu")[0]):
        model = GPT(cfg, nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax.device_put(params, jax.devices()[0])
    optimizer = optax.adamw(3e-4)

    def train_step(carry, batch):
        params, opt_state = carry
        loss, grads = jax.value_and_grad(lambda p: next_token_loss(nnx.merge(graphdef, p, rest), batch))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    per_call = STEPS_PER_SCAN if mode == "scan" else 1
    shape = (per_call, batch_size, cfg.seq_len + 1)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, shape, dtype=np.int32))
    if mode == "scan":
        call = jax.jit(lambda carry, batch: jax.lax.scan(train_step, carry, batch), donate_argnums=0)
        batch = {"tokens": tokens}
    else:
        call = jax.jit(train_step, donate_argnums=0)
        batch = {"tokens": tokens[0]}
    carry = (params, jax.jit(optimizer.init)(params))
    for _ in range(2):  # compiles, then warms up
        carry, _ = call(carry, batch)
    windows, calls = [], []
    for _ in range(3):
        jax.block_until_ready(carry)
        start = time.perf_counter()
        for _ in range(12 // per_call):
            called = time.perf_counter()
            carry, _ = call(carry, batch)
            calls.append((time.perf_counter() - called) / per_call)
        jax.block_until_ready(carry)
        windows.append((time.perf_counter() - start) / 12)
    seconds = statistics.median(windows)
    stats = jax.devices()[0].memory_stats() or {}
    flops = batch_size * cfg.seq_len * families.family_of(cfg).flops_per_token(cfg)
    result = {
        "flavor": flavor,
        "batch": batch_size,
        "mode": mode,
        "ms": 1e3 * seconds,
        "mfu": flops / seconds / 989e12,
        "call_ms": 1e3 * statistics.median(calls),
        "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[3] not in ("loop", "scan"):
        raise SystemExit(__doc__)
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
