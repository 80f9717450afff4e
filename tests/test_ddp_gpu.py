"""DDP and ZeRO-1 with the nccl backend on the GPU, against the xla backend (marked `gpu`)."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh

from jaxdist.ddp import DDP
from tests.test_ddp import make_case

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("zero1", [False, True], ids=["ddp", "zero1"])
def test_nccl_backend_matches_xla_backend(zero1):
    from jaxdist.comm import nccl

    gpus = jax.devices("gpu")
    mesh = Mesh(np.asarray(gpus[:1]), ("dp",), axis_types=(AxisType.Explicit,))
    nccl.init(mesh)
    make_model, loss_fn, batches = make_case("gpt", 4)
    results = {}
    for backend in ("nccl", "xla"):
        run = DDP(mesh, zero1=zero1, bucket_size=1000, backend=backend).prepare(
            make_model(), optax.adam(1e-3), loss_fn, batches[0]
        )
        state, losses = run.state, []
        for batch in batches:
            state, m = run.step(state, batch)
            losses.append(float(m["loss"]))
        results[backend] = (losses, jax.tree.map(np.asarray, run.params(state)))
    assert len(set(results["nccl"][0])) == len(batches)  # the weights changed every step
    np.testing.assert_allclose(results["nccl"][0], results["xla"][0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(results["nccl"][1]), jax.tree.leaves(results["xla"][1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
