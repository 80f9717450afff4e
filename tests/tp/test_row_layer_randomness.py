"""A row layer that draws random numbers: each tp rank runs its call on its slices and the ranks' results
are summed after it. Without sequence parallelism every tp rank draws the same mask, so a dropout of the
product is the dropout of the sum; under it each rank draws its own, and the sum of differently masked
partial products was no dropout at all: a p = 0.5 dropout zeroed 25% of the outputs, not 50%. Such a
layer is refused under sequence parallelism, with the fix that works (the dropout after the layer) tested
too. A row layer holding an RNG stream was not checked at all (its trace failed and the check gave up):
an activation inside it now is refused like any other."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh

from jaxdist.engine.run import Parallel, Units
from jaxdist.tp import plan as tp_plan


class Dense(nnx.Module):
    """A hand-written dense layer, `w` [in, out], with a dropout in one of the places the tests name."""

    def __init__(self, din: int, dout: int, form: str, rngs: nnx.Rngs):
        self.form = form
        self.w = nnx.Param(jax.random.normal(rngs.params(), (din, dout)) + 3.0)  # no product is zero by chance
        self.drop = nnx.Dropout(0.0 if form == "after" else 0.5, rngs=rngs)

    def __call__(self, x):
        if self.form == "input":  # a dropout of the input: each rank masks its own features, as one device does
            return self.drop(x) @ self.w[...]
        y = self.drop(x @ self.w[...])
        return jax.nn.relu(y) if self.form == "relu" else y


class Block(nnx.Module):
    def __init__(self, form: str, rngs: nnx.Rngs):
        self.up = nnx.Linear(8, 16, rngs=rngs)
        self.down = Dense(16, 8, form, rngs)
        self.after = nnx.Dropout(0.5 if form == "after" else 0.0, rngs=rngs)  # "after": the layer's output

    def __call__(self, x):
        return self.after(self.down(jnp.abs(self.up(x)) + 1.0))


class Net(nnx.Module):
    def __init__(self, form: str, rngs: nnx.Rngs):
        self.inp = nnx.Linear(6, 8, rngs=rngs)
        self.blocks = nnx.List([Block(form, rngs)])
        self.out = nnx.Linear(8, 8, use_bias=False, rngs=rngs)
        self.out.kernel[...] = jnp.eye(8)  # the head reads the blocks' output whole (a column layer gathers it)


def zero_fraction(model, h, batch):
    """The share of the last block's outputs that are zero (no gradient: the model is only run)."""
    h = model.out(h)
    return jnp.mean((h == 0).astype(jnp.float32)) + 0.0 * jnp.sum(h)


UNITS = Units(embed=lambda m, b: m.inp(b["x"]), head_loss=zero_fraction)
PLAN = tp_plan.TPPlan(
    {"blocks/*/up": tp_plan.column(), "blocks/*/down": tp_plan.row(), "out": tp_plan.column(gather_output=True)}
)
BATCH = {"x": np.random.default_rng(0).normal(size=(64, 6)).astype(np.float32)}


def prepare(form: str, sequence_parallel: bool):
    mesh = cpu_mesh((4, 2), ("dp", "tp"))
    strategy = Parallel(mesh, plan=PLAN, sequence_parallel=sequence_parallel)
    return strategy.prepare(Net(form, nnx.Rngs(0)), optax.sgd(0.0), UNITS, BATCH)


def test_a_row_layer_masking_its_product_at_random_is_refused_under_sequence_parallelism():
    with pytest.raises(ValueError, match=r"blocks/0/down \(Dense\) is row parallel and applies random numbers"):
        prepare("product", sequence_parallel=True)


def test_a_row_layer_with_an_rng_stream_and_an_activation_is_refused():
    with pytest.raises(ValueError, match="applies max, which is not linear, to the product"):
        prepare("relu", sequence_parallel=False)


@pytest.mark.parametrize(
    "form, sequence_parallel",
    [("product", False), ("after", True)],  # the same mask on every tp rank; the fix the refusal names
)
def test_a_dropout_of_the_product_zeroes_its_rate_of_the_outputs(form, sequence_parallel):
    run = prepare(form, sequence_parallel)
    _, metrics = run.step(run.state, BATCH)
    assert 0.4 < float(metrics["loss"]) < 0.6, float(metrics["loss"])  # 512 outputs at p = 0.5; 0.25 if wrong


def test_a_row_layer_dropping_its_input_is_accepted_under_sequence_parallelism():
    run = prepare("input", sequence_parallel=True)
    _, metrics = run.step(run.state, BATCH)
    assert float(metrics["loss"]) == 0.0  # the input's dropout zeroes no output of the matmul
