"""`max_grad_norm` is documented as `optax.clip_by_global_norm` first in a chain: checked at a small
gradient norm (a loss of scale 1e-5, as late in training or in fine-tuning), where an epsilon added
to the norm (PyTorch's `clip_grad_norm_` adds 1e-6) shrinks the clipped update by a visible
fraction, against a single-device optax chain with SGD (scale-sensitive), for every strategy.
"""

import optax
import pytest
from flax import nnx
from meshes import cpu_mesh
from test_review_models_engine import ODD_UNITS, OddMLP, assert_same_training, odd_batches, odd_loss, reference, train

from jaxdist.ddp import DDP
from jaxdist.engine import Parallel, Units
from jaxdist.pipeline import Pipelined

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
    first_norm = reference(make_model, small_loss, batches[:1], optax.sgd(0.0))[2][0]
    clip = 0.25 * first_norm  # active at every step
    chain = optax.chain(optax.clip_by_global_norm(clip), optax.sgd(LR))
    return clip, batches, reference(make_model, small_loss, batches, chain)


@pytest.mark.parametrize("name", STRATEGIES)
def test_the_clip_at_a_small_gradient_norm_is_optax_clip_by_global_norm(clipped_reference, name):
    clip, batches, (ref_losses, ref_params, ref_norms) = clipped_reference
    assert min(ref_norms) > clip and max(ref_norms) < 1e-3  # clipped, and small enough for an epsilon to show
    strategy = STRATEGIES[name](clip)
    if isinstance(strategy, DDP):
        run = strategy.prepare(make_model(), optax.sgd(LR), small_loss, batches[0])
    else:
        run = strategy.prepare(make_model(), optax.sgd(LR), SMALL_UNITS, batches[0])
    # with the epsilon: 1e-3 off in the loss of step 2, 2e-2 in the parameters
    assert_same_training(train(run, batches), (ref_losses, ref_params, ref_norms))
