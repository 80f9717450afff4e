"""One of two processes of the per-rank program tests: pp=2 with each process holding one pp rank, every
schedule run as per-rank programs against a single-device optax run on this process's CPU.

    per_rank_driver.py PROCESS COORDINATOR PLATFORM BACKEND OUT

PLATFORM `cpu`: 4 CPU devices per process (gloo), a pp=2 x dp=4 mesh (pp=2 x dp=2 x tp=2 with the
MLP's plan for one case); `gpu`: the one GPU the parent left visible, a pp=2 mesh of both processes'
GPUs. Each case trains a residual MLP for 5 steps and compares the losses, gradient norms and final
parameters with the reference; OUT gets one JSON object: each case's error (null when it matched).
"""

import json
import sys
import traceback


def main(process: int, coordinator: str, platform: str, backend: str, out: str) -> None:
    import os

    if platform == "cpu":
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax

    if platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, 2, process)

    import numpy as np
    import optax
    from flax import nnx
    from jax.experimental import multihost_utils
    from support.models import MLP_PLAN, MLP_UNITS, ResMLP, mlp_batches, mlp_loss
    from support.reference import LOSS_RTOL, assert_params_close, train_single_device

    from jaxdist.pipeline.run import Pipelined

    devices = np.asarray(jax.devices(platform))
    if platform == "cpu":  # each process's 4 devices one pp rank: dp=4, or dp=2 x tp=2 with the MLP's plan
        meshes = {"dp": jax.sharding.Mesh(devices.reshape(2, 4), ("pp", "dp"))}
        meshes["tp"] = jax.sharding.Mesh(devices.reshape(2, 2, 2), ("pp", "dp", "tp"))
    else:  # one GPU per process
        meshes = dict.fromkeys(("dp", "tp"), jax.sharding.Mesh(devices.reshape(2), ("pp",)))
    if backend == "nccl":
        from jaxdist.comm import nccl

        nccl.init(meshes["dp"])
    cases = {  # name: (Pipelined options, optimizer)
        "1f1b-m4-sgd": (dict(microbatches=4), "sgd"),
        "1f1b-m8-adamw-tp": (dict(microbatches=8, plan=MLP_PLAN), "adamw"),
        "interleaved-v2-m4-recompute-sgd": (dict(microbatches=4, schedule="interleaved", virtual=2, remat=True), "sgd"),
        "zbh1-m4-adamw": (dict(microbatches=4, schedule="zb-h1"), "adamw"),
    }
    optimizers = {"sgd": lambda: optax.sgd(0.1), "adamw": lambda: optax.adamw(1e-3)}
    batches = mlp_batches(5)
    errors = {}

    def make():
        return ResMLP(nnx.Rngs(0), layers=4)

    for name, (options, kind) in cases.items():
        optimizer = optimizers[kind]
        try:
            reference = train_single_device(make, mlp_loss, batches, optimizer())
            mesh = meshes["tp" if "plan" in options else "dp"]
            if "tp" not in mesh.axis_names:  # one GPU per process: no tp axis to split over
                options = {k: v for k, v in options.items() if k != "plan"}
            strategy = Pipelined(mesh, backend=backend, per_rank_programs=True, **options)
            run = strategy.prepare(make(), optimizer(), MLP_UNITS, batches[0])
            state, losses, norms = run.state, [], []
            for batch in batches:
                placed = {
                    k: jax.make_array_from_callback(v.shape, run.step.batch_sharding, lambda i, v=v: v[i])
                    for k, v in batch.items()
                }
                state, metrics = run.step(state, placed)
                losses.append(float(np.asarray(metrics["loss"].addressable_data(0))))
                norms.append(float(np.asarray(metrics["grad_norm"].addressable_data(0))))
            params = multihost_utils.process_allgather(nnx.to_pure_dict(run.params(state)), tiled=True)
            np.testing.assert_allclose(losses, reference.losses, rtol=LOSS_RTOL)
            np.testing.assert_allclose(norms, reference.grad_norms, rtol=1e-5)
            # SGD: rounding only; Adam: its per-coordinate scaling (tests/support/reference.py's tolerances)
            assert_params_close(params, reference.params, **({"atol": 1e-5} if kind == "sgd" else {}))
            errors[name] = None
        except Exception:  # noqa: BLE001 (reported to the test, which fails naming the case)
            errors[name] = traceback.format_exc()[-2000:]
    with open(out, "w") as f:
        json.dump(errors, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5])
