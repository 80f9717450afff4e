"""Vocabulary-parallel logits (a `loss_parallel` head's) read any way but `tp_plan.cross_entropy` raise
the documented error: attributes, arithmetic, jnp and jax.nn functions, optax's losses, numpy."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh

from jaxdist.engine.run import Parallel
from jaxdist.models.gpt import GPT, UNITS, GPTConfig, tp_plan_for
from jaxdist.tp import plan as tp_plan
from jaxdist.tp.bind import Binding

MISUSE = "only jaxdist.tp.plan.cross_entropy"
LABELS = jnp.zeros((2, 3), jnp.int32)

READS = {
    "ndim": lambda lg: lg.ndim,
    "size": lambda lg: lg.size,
    "T": lambda lg: lg.T,
    "reshape": lambda lg: lg.reshape(-1),
    "astype": lambda lg: lg.astype(jnp.float32),
    "sum method": lambda lg: lg.sum(-1),
    "add": lambda lg: lg + 1.0,
    "index": lambda lg: lg[..., 0],
    "jnp.sum": lambda lg: jnp.sum(lg),
    "jnp.max": lambda lg: jnp.max(lg, axis=-1),
    "jnp.asarray": lambda lg: jnp.asarray(lg),
    "log_softmax": lambda lg: jax.nn.log_softmax(lg),
    "logsumexp": lambda lg: jax.nn.logsumexp(lg, axis=-1),
    "optax": lambda lg: optax.softmax_cross_entropy_with_integer_labels(lg, LABELS),
    "np.asarray": lambda lg: np.asarray(lg),
    "np.sum": lambda lg: np.sum(lg),
    "compare": lambda lg: lg > 0,
}


@pytest.mark.parametrize("read", list(READS))
def test_every_read_of_split_logits_but_the_parallel_loss_raises_the_documented_error(read):
    logits = tp_plan.VocabShardedLogits(jnp.zeros((2, 3, 8)), Binding("tp", 2))
    with pytest.raises(ValueError, match=MISUSE):
        READS[read](logits)
    assert logits.shape == (2, 3, 8)  # its shape and dtype stay readable (they are not the values)


def test_a_loss_reading_split_logits_through_an_attribute_raises_at_prepare():
    """A head whose loss reads `logits.ndim` (as many losses do) fails at prepare with the documented error."""
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=1)

    def head_loss(model, x, batch):
        logits = model.logits(x)
        axis = logits.ndim - 1
        return -jnp.mean(jax.nn.log_softmax(logits, axis=axis)[..., 0])

    units = dataclasses.replace(UNITS, head_loss=head_loss)
    batch = {"tokens": np.zeros((8, 17), np.int32)}
    with pytest.raises(ValueError, match=MISUSE):
        Parallel(cpu_mesh((4, 2), ("dp", "tp")), plan=tp_plan_for(cfg)).prepare(
            GPT(cfg, nnx.Rngs(0)), optax.sgd(0.1), units, batch
        )
