"""Models that `sow` (nnx.Intermediate) train as plain `jit` does: an auxiliary loss the loss reads with
`nnx.pop` counts under DDP, whatever is left sown is dropped after each forward (it used to change the
model state's tree and fail at `prepare` with "Too many leaves for PyTreeDef"), and the unit engine,
whose loss cannot read what its blocks sow, says so once."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.models import Net, NetBlock, net_batches, net_embed, net_head_loss
from support.reference import train_single_device
from support.runs import train

from jaxdist.ddp import DDP
from jaxdist.engine.fsdp import FSDP, Units

LR = 0.5  # SGD: a gradient off by any factor shows in the parameters


class SowingBlock(NetBlock):
    """A block that sows an auxiliary loss (as MoE routers sow a load-balancing loss)."""

    def __call__(self, x):
        y = super().__call__(x)
        self.sow(nnx.Intermediate, "aux", jnp.mean(y**2))
        return y


class SowingNet(Net):
    def __init__(self, rngs):
        super().__init__([0.5, 1.5], rngs)
        self.blocks = nnx.List([SowingBlock(g, rngs) for g in (0.5, 1.5)])


def model():
    return SowingNet(nnx.Rngs(0))


def loss_with_aux(m, batch):
    x = net_embed(m, batch)
    for block in m.blocks:
        x = block(x)
    aux = sum(jax.tree.leaves(nnx.pop(m, nnx.Intermediate)))
    return net_head_loss(m, x, batch) + 0.1 * aux


def loss_ignoring_sown(m, batch):
    x = net_embed(m, batch)
    for block in m.blocks:
        x = block(x)
    return net_head_loss(m, x, batch)


def assert_as_reference(got, ref):
    losses, params, norms, _ = got
    np.testing.assert_allclose(losses, ref.losses, rtol=5e-6)
    np.testing.assert_allclose(norms, ref.grad_norms, rtol=5e-6)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize("loss", [loss_with_aux, loss_ignoring_sown], ids=["aux-loss-popped", "left-sown"])
def test_ddp_trains_a_sowing_model_as_one_device(loss):
    batches = net_batches(2)
    ref = train_single_device(model, loss, batches, optax.sgd(LR))
    run = DDP(cpu_mesh((8,), ("dp",)), zero1=True).prepare(model(), optax.sgd(LR), loss, batches[0])
    assert_as_reference(train(run, batches), ref)
    if loss is loss_with_aux:  # the aux term really is in the loss (else the two cases would be one)
        without = train_single_device(model, loss_ignoring_sown, batches[:1], optax.sgd(LR)).losses[0]
        assert abs(ref.losses[0] - without) > 1e-3


def test_the_engine_drops_what_blocks_sow_and_says_so_once():
    batches = net_batches(2)
    ref = train_single_device(model, loss_ignoring_sown, batches, optax.sgd(LR))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        run = FSDP(cpu_mesh((8,), ("fsdp",))).prepare(
            model(), optax.sgd(LR), Units(net_embed, net_head_loss), batches[0]
        )
        got = train(run, batches)
    said = [str(w.message) for w in caught if "nnx.Intermediate" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("a block sows 'aux' (nnx.Intermediate), which no loss can read"), said
    assert_as_reference(got, ref)
