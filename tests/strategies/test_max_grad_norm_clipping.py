"""`max_grad_norm` is documented as `optax.clip_by_global_norm` first in a chain: checked at a small
gradient norm (a loss of scale 1e-5, as late in training or in fine-tuning), where an epsilon added
to the norm (PyTorch's `clip_grad_norm_` adds 1e-6) shrinks the clipped update by a visible
fraction, and with float64 gradients, which a float32 norm clips at float32 precision; against a
single-device optax chain with SGD (scale-sensitive).
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.models import MLP64, ODD_UNITS, UNITS64, OddMLP, loss64, odd_batches, odd_loss
from support.reference import assert_same_training, train_single_device
from support.runs import train

from jaxdist.ddp.run import DDP
from jaxdist.engine.run import Parallel, Units
from jaxdist.pipeline.run import Pipelined

SCALE = 1e-5  # gradient norms ~2e-4
LR = 500.0  # so the parameters move as at an ordinary scale


def small_loss(model, batch):
    return SCALE * odd_loss(model, batch)


SMALL_UNITS = Units(
    embed=ODD_UNITS.embed, head_loss=lambda m, x, b: SCALE * ODD_UNITS.head_loss(m, x, b), blocks="layers"
)


def make_model():
    return OddMLP(nnx.Rngs(0), layers=4)  # 4 identical blocks: 2 pipeline stages


STRATEGIES = {
    "ddp": lambda clip: DDP(cpu_mesh((8,), ("dp",)), max_grad_norm=clip),
    "zero1-accumulate": lambda clip: DDP(cpu_mesh((4,), ("dp",)), zero1=True, accumulation_steps=2, max_grad_norm=clip),
    "fsdp": lambda clip: Parallel(cpu_mesh((8,), ("fsdp",)), max_grad_norm=clip),
    "hsdp2x4": lambda clip: Parallel(cpu_mesh((2, 4), ("dp", "fsdp")), max_grad_norm=clip),
    "pp2xdp4": lambda clip: Pipelined(cpu_mesh((2, 4), ("pp", "dp")), microbatches=2, max_grad_norm=clip),
}


@pytest.fixture(scope="module")
def clipped_reference():
    batches = odd_batches(3)
    first_norm = train_single_device(make_model, small_loss, batches[:1], optax.sgd(0.0))[2][0]
    clip = 0.25 * first_norm  # active at every step
    chain = optax.chain(optax.clip_by_global_norm(clip), optax.sgd(LR))
    return clip, batches, train_single_device(make_model, small_loss, batches, chain)


# the engine's FSDP alone is slow: hsdp2x4 clips over its fsdp axis (and a dp axis) in the fast run
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow if n == "fsdp" else ()) for n in STRATEGIES])
def test_the_clip_at_a_small_gradient_norm_is_optax_clip_by_global_norm(clipped_reference, name):
    clip, batches, (ref_losses, ref_params, ref_norms, _) = clipped_reference
    assert min(ref_norms) > clip and max(ref_norms) < 1e-3  # clipped, and small enough for an epsilon to show
    strategy = STRATEGIES[name](clip)
    if isinstance(strategy, DDP):
        run = strategy.prepare(make_model(), optax.sgd(LR), small_loss, batches[0])
    else:
        run = strategy.prepare(make_model(), optax.sgd(LR), SMALL_UNITS, batches[0])
    # with the epsilon: 1e-3 off in the loss of step 2, 2e-2 in the parameters
    assert_same_training(train(run, batches), (ref_losses, ref_params, ref_norms))


# -- float64: the clip at float64 precision --------------------------------------------------------


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_the_clip_of_float64_gradients_is_exact_in_float64(name):
    """A float32 norm clipped float64 gradients at float32 precision: parameters 4e-9 off one device's
    (an optax clip in the chain, through the same strategy, was 1e-16 off)."""
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        batches = [{"x": rng.normal(size=(16, 4)), "y": rng.normal(size=(16, 2))} for _ in range(3)]

        def make():
            return MLP64(nnx.Rngs(0))

        clip = train_single_device(make, loss64, batches[:1], optax.sgd(0.0))[2][0] / 3
        ref_losses, ref_params, ref_norms, _ = train_single_device(
            make, loss64, batches, optax.chain(optax.clip_by_global_norm(clip), optax.sgd(0.3))
        )
        if name == "ddp":
            run = DDP(cpu_mesh((8,), ("dp",)), max_grad_norm=clip).prepare(make(), optax.sgd(0.3), loss64, batches[0])
        else:
            run = Parallel(cpu_mesh((8,), ("fsdp",)), max_grad_norm=clip).prepare(
                make(), optax.sgd(0.3), UNITS64, batches[0]
            )
        _, params, norms, _ = train(run, batches)
    assert min(ref_norms) > clip  # clipped at every step
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-12)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        assert got.dtype == np.float64
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-14)
