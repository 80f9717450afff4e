"""Model variables the forward updates from the data, other than nnx.BatchStat (a running mean kept in a
Variable subclass of the user's, a count of rows seen), end up different on every data rank: each rank
keeps what its own rows give and the checkpoint holds the first rank's (8 values of one statistic, a count
of 6 against one device's 48). `prepare` says so; variables the forward leaves alone, batch statistics,
and the RNG streams' counts (the same on every rank) say nothing."""

import warnings

import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.models import NET_UNITS, Net, net_batches, net_embed, net_head_loss, net_loss

from jaxdist.ddp import DDP
from jaxdist.engine.fsdp import FSDP, Units

WARNING = "the forward updates the model variables"


class RunningMean(nnx.Variable):
    """A user's own kind of state: an exponential mean of the inputs."""


class Tracked(Net):
    def __init__(self, rngs):
        super().__init__([0.5, 1.5], rngs)
        self.mean = RunningMean(jnp.zeros(()))
        self.seen = nnx.Variable(jnp.zeros((), jnp.int32))


def count_and_average(m, batch):
    m.mean[...] = 0.9 * m.mean[...] + 0.1 * jnp.mean(batch["x"])
    m.seen[...] = m.seen[...] + batch["x"].shape[0]


def tracked_loss(m, batch):
    count_and_average(m, batch)
    return net_loss(m, batch)


def tracked_embed(m, batch):
    count_and_average(m, batch)
    return net_embed(m, batch)


def prepared(strategy: str, model, batch):
    if strategy == "ddp":
        return DDP(cpu_mesh((8,), ("dp",))).prepare(model, optax.sgd(0.1), tracked_loss, batch)
    return FSDP(cpu_mesh((8,), ("fsdp",))).prepare(model, optax.sgd(0.1), Units(tracked_embed, net_head_loss), batch)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_variable_updated_from_the_data_is_warned_of_by_name(strategy):
    batch = net_batches(1)[0]
    with pytest.warns(UserWarning, match=rf"{WARNING} 'mean', 'seen', which are neither parameters nor"):
        run = prepared(strategy, Tracked(nnx.Rngs(0)), batch)
        run.step(run.state, batch)


class CountingNet(Net):
    """Counts its forwards in an integer batch statistic (as PyTorch's num_batches_tracked)."""

    def __init__(self, rngs):
        super().__init__([0.5, 1.5], rngs, batchnorm=True, dropout=0.1, input_dropout=0.1)
        self.calls = nnx.BatchStat(jnp.zeros((), jnp.int32))


def counting_loss(m, batch):
    m.calls[...] = m.calls[...] + 1
    return net_loss(m, batch)


def test_untouched_variables_batch_statistics_and_dropout_say_nothing():
    batch = net_batches(1)[0]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=WARNING)
        run = DDP(cpu_mesh((8,), ("dp",))).prepare(CountingNet(nnx.Rngs(0)), optax.sgd(0.1), counting_loss, batch)
        run.step(run.state, batch)
        for remat in (None, True):  # under jax.checkpoint every variable comes back anew: nothing is known
            model = Net([0.5, 1.5], nnx.Rngs(0), batchnorm=True, dropout=0.1)  # its blocks' gains are read only
            run = FSDP(cpu_mesh((8,), ("fsdp",)), remat=remat).prepare(model, optax.sgd(0.1), NET_UNITS, batch)
            run.step(run.state, batch)
