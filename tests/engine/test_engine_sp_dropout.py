"""Dropout under sequence parallelism: each tp rank holds its own chunk of the tokens, so a block's
masks must differ between the chunks, as one device draws a different mask for every token
(every tp rank drawing the same key would repeat one chunk's mask on every other chunk)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh

from jaxdist.engine.run import Parallel, Units
from jaxdist.tp import plan as tp_plan

B, S, D_IN, D, D_OUT = 8, 4, 3, 16, 4


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.up = nnx.Linear(D, 2 * D, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, rngs=rngs)

    def __call__(self, x):
        x = self.drop(x)  # between tp layers: on this rank's chunk under sequence parallelism
        return x + self.down(jax.nn.relu(self.up(x)))


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.inp = nnx.Linear(D_IN, D, rngs=rngs)
        self.layers = nnx.List([Block(rngs) for _ in range(2)])
        self.out = nnx.Linear(D, D_OUT, rngs=rngs)


PLAN = tp_plan.TPPlan(
    {"layers/*/up": tp_plan.column(), "layers/*/down": tp_plan.row(), "out": tp_plan.column(gather_output=True)}
)


def head(m, x, b):
    y = m.out(x)
    return jnp.mean(y**2), jnp.sum(y, axis=2)  # the loss, and one value per token


UNITS = Units(embed=lambda m, b: m.inp(b["x"]), head_loss=head, blocks="layers", has_aux=True)


def per_token(sequence_dim):
    token = np.random.default_rng(0).normal(size=(D_IN,)).astype(np.float32)
    batch = {"x": np.broadcast_to(token, (B, S, D_IN)).copy()}  # every token the same: only masks differ
    strategy = Parallel(cpu_mesh((1, 2), ("dp", "tp")), plan=PLAN, sequence_parallel=True, sequence_dim=sequence_dim)
    run = strategy.prepare(Net(nnx.Rngs(0, dropout=1)), optax.sgd(0.0), UNITS, batch)
    _, metrics = run.step(run.state, batch)
    return np.asarray(metrics["aux"])


@pytest.mark.parametrize("sequence_dim", [0, 1], ids=["batch-split", "sequence-split"])
def test_each_tp_ranks_chunk_of_the_tokens_draws_its_own_masks(sequence_dim):
    values = per_token(sequence_dim)  # rank 0 holds examples 0-3 (or positions 0-1), rank 1 the rest
    assert values.shape == (B, S)
    assert len(set(np.round(values.ravel(), 4))) == B * S, values  # no two tokens share their masks
