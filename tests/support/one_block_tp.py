"""A model of one residual block between a 6 -> 8 input layer and an 8 -> 4 output layer, its loss and units,
and a plan placing the block's `up` column and `down` row parallel on dp4 x tp2: the setting of the tests
of layers a model writes itself under tp (tests/tp/test_row_layer_linearity.py,
tests/tp/test_column_layer_locality.py)."""

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdist.engine.run import Parallel, Units
from jaxdist.tp import plan as tp_plan
from support.meshes import cpu_mesh


class OneBlockNet(nnx.Module):
    def __init__(self, make_block, rngs: nnx.Rngs):
        self.inp = nnx.Linear(6, 8, rngs=rngs)
        self.blocks = nnx.List([make_block(rngs)])
        self.out = nnx.Linear(8, 4, rngs=rngs)


class Block(nnx.Module):
    """`x + down(tanh(up(x)))`, `up` 8 -> 16 and `down` 16 -> 8 made by the callers' functions of the rngs."""

    def __init__(self, make_up, make_down, rngs: nnx.Rngs):
        self.up = make_up(rngs)
        self.down = make_down(rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


def mlp_net(make_up, make_down, rngs: nnx.Rngs) -> OneBlockNet:
    return OneBlockNet(lambda r: Block(make_up, make_down, r), rngs)


def head_loss(model, h, batch):
    return jnp.mean((model.out(h) - batch["y"]) ** 2)


def loss_fn(model, batch):
    h = model.inp(batch["x"])
    for block in model.blocks:
        h = block(h)
    return head_loss(model, h, batch)


UNITS = Units(embed=lambda m, b: m.inp(b["x"]), head_loss=head_loss)
PLAN = tp_plan.TPPlan({"blocks/*/up": tp_plan.column(), "blocks/*/down": tp_plan.row()})
RNG = np.random.default_rng(0)
BATCHES = [{"x": RNG.normal(size=(8, 6)).astype(np.float32), "y": RNG.normal(size=(8, 4)).astype(np.float32)}] * 2


def prepare(model, plan=PLAN):
    """`model` prepared on dp4 x tp2 with `plan`, SGD."""
    return Parallel(cpu_mesh((4, 2), ("dp", "tp")), plan=plan).prepare(model, optax.sgd(0.1), UNITS, BATCHES[0])
