"""On a one-device mesh nothing moves: the unit engine (`Parallel` with ZeRO-1 or replicated storage
over dp, FSDP over an fsdp axis of size 1) compiles a step with no collectives and no copies into
flat buffers, and trains exactly as plain optax under `jit` does."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.one_device import GPT_CFG, collectives, copies, plain_compiled, plain_sgd, pure, token_batches

from jaxdist.engine.fsdp import FSDP, Units
from jaxdist.engine.run import Parallel
from jaxdist.models.gpt import GPT, UNITS, embed_inputs, head_loss, next_token_loss

LR, STEPS = 0.1, 3

STRATEGIES = {
    "parallel-zero1": lambda: Parallel(cpu_mesh((1,), ("dp",))),
    "parallel-replicated": lambda: Parallel(cpu_mesh((1,), ("dp",)), zero1=False),
    "fsdp1": lambda: FSDP(cpu_mesh((1,), ("fsdp",))),
}


@pytest.fixture(scope="module")
def reference():
    return plain_sgd(GPT(GPT_CFG, nnx.Rngs(0)), next_token_loss, token_batches(STEPS), LR)


@pytest.fixture(scope="module")
def plain_text():
    return plain_compiled(GPT(GPT_CFG, nnx.Rngs(0)), next_token_loss, optax.sgd(LR), token_batches(1)[0]).as_text()


@pytest.fixture(scope="module", params=list(STRATEGIES))
def trained(request):
    """`(name, compiled step text, losses, grad norms, final parameters)` of 3 SGD steps."""
    strategy = STRATEGIES[request.param]()
    units = Units(embed_inputs, head_loss) if isinstance(strategy, FSDP) else UNITS
    run = strategy.prepare(GPT(GPT_CFG, nnx.Rngs(0)), optax.sgd(LR), units, token_batches(1)[0])
    text = run.step.lower(run.state, token_batches(1)[0]).compile().as_text()
    state, losses, norms = run.state, [], []
    for batch in token_batches(STEPS):
        state, metrics = run.step(state, batch)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return request.param, text, losses, norms, run.params(state)


def test_one_device_step_has_no_collectives_and_no_buffer_copies(trained, plain_text):
    name, text, *_ = trained
    assert collectives(text) == [], f"{name} communicates on one device"
    assert copies(text) == copies(plain_text), f"{name} copies into buffers the plain step has not"


def test_one_device_step_trains_as_plain_jit(trained, reference):
    name, _, losses, norms, params = trained
    ref_losses, ref_norms, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5, err_msg=name)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), pure(params), ref_params)
