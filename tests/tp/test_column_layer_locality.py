"""A column layer of the model's own type runs its own call on the whole input and each tp rank's slice of
its weight, and each rank takes the result as its slice of the layer's output. A call that computes
across its output features (a norm over them, a softmax, a cumulative sum, a reversal) trained silently
wrong: dp4 x tp2 first loss 2.195 against one device's 1.891 for an L2 norm, 2.245 against 1.430 for a
reversal. `prepare` now runs such a layer on random inputs of its traced shapes, whole and on each
rank's pieces, and refuses one whose pieces are not slices of its whole output; element-wise code (an
activation, its bias) trains as on one device, and a second per-feature parameter (which jaxdist does
not split) is named instead of failing as a bare broadcast error."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.reference import assert_same_training, train_single_device
from support.runs import train

from jaxdist.engine.run import Parallel, Units
from jaxdist.tp import plan as tp_plan

FORMS = {
    "l2": lambda y: y / jnp.linalg.norm(y, axis=-1, keepdims=True),
    "softmax": lambda y: jax.nn.softmax(y, axis=-1),
    "cumsum": lambda y: jnp.cumsum(y, axis=-1),
    "reversed": lambda y: y[..., ::-1],
}


class Dense(nnx.Module):
    """A hand-written dense layer, `w` [in, out], whose call ends in one of FORMS (or acts per feature)."""

    def __init__(self, din: int, dout: int, form: str, rngs: nnx.Rngs):
        self.form = form
        self.w = nnx.Param(jax.random.normal(rngs.params(), (din, dout)) / np.sqrt(din))
        self.bias = nnx.Param(jnp.linspace(-0.5, 0.5, dout))
        self.gain = nnx.Param(jnp.linspace(0.5, 1.5, dout))

    def __call__(self, x):
        y = x @ self.w[...] + self.bias[...]
        if self.form in FORMS:
            return FORMS[self.form](y)
        if self.form == "gain":  # a second per-feature parameter, which jaxdist does not split
            return y * self.gain[...]
        return jax.nn.gelu(y)  # per feature: each rank's features whole


class Block(nnx.Module):
    def __init__(self, form: str, rngs: nnx.Rngs):
        self.up = Dense(8, 16, form, rngs)
        self.down = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


class Net(nnx.Module):
    def __init__(self, form: str, rngs: nnx.Rngs):
        self.inp = nnx.Linear(6, 8, rngs=rngs)
        self.blocks = nnx.List([Block(form, rngs)])
        self.out = nnx.Linear(8, 4, rngs=rngs)


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


def prepare(form: str):
    mesh = cpu_mesh((4, 2), ("dp", "tp"))
    return Parallel(mesh, plan=PLAN).prepare(Net(form, nnx.Rngs(0)), optax.sgd(0.1), UNITS, BATCHES[0])


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_column_layer_computing_across_its_output_features_is_refused(form):
    with pytest.raises(ValueError, match=r"blocks/0/up \(Dense\) is column parallel: .* computes across output"):
        prepare(form)


def test_a_column_layer_with_a_second_per_feature_parameter_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"blocks/0/up \(Dense\) is column parallel, and its call fails .* \(a gain\)"):
        prepare("gain")


def test_a_column_layer_acting_per_output_feature_trains_as_on_one_device():
    want = train_single_device(lambda: Net("per_feature", nnx.Rngs(0)), loss_fn, BATCHES, optax.sgd(0.1))
    assert_same_training(train(prepare("per_feature"), BATCHES), want)
