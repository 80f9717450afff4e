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
from support.one_block_tp import BATCHES, loss_fn, mlp_net
from support.one_block_tp import prepare as prepare_on_dp4_tp2
from support.reference import assert_same_training, train_single_device
from support.runs import train

from jaxdist.tp import plan as tp_plan

FORMS = {
    "l2": lambda y: y / jnp.linalg.norm(y, axis=-1, keepdims=True),
    "softmax": lambda y: jax.nn.softmax(y, axis=-1),
    "cumsum": lambda y: jnp.cumsum(y, axis=-1),
    "reversed": lambda y: y[..., ::-1],
    "centred": lambda y: y - jnp.mean(y, axis=-1, keepdims=True),  # small where the inputs' mean is zero
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


def Net(form: str, rngs: nnx.Rngs):
    return mlp_net(lambda r: Dense(8, 16, form, r), lambda r: nnx.Linear(16, 8, rngs=r), rngs)


def prepare(form: str):
    return prepare_on_dp4_tp2(Net(form, nnx.Rngs(0)))


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


class NormedLinear(nnx.Linear):
    """A flax layer subclass whose own call normalizes over the features super() returns (a slice)."""

    def __call__(self, x):
        y = super().__call__(x)
        return y / jnp.linalg.norm(y, axis=-1, keepdims=True)


def test_a_flax_linear_subclass_normalizing_its_output_features_is_refused():
    model = Net("per_feature", nnx.Rngs(0))
    model.blocks[0].up = NormedLinear(8, 16, rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match=r"blocks/0/up \(NormedLinear\) is column parallel: .* computes across"):
        prepare_on_dp4_tp2(model)


class HeadProjection(nnx.Module):
    """w [D, heads * head_dim], output [..., heads, head_dim] by a head count the plan divides; its weight
    read with its metadata; or, `fused`, SwiGLU's gate and up in one weight (column(groups=2)), whose
    output has half the weight's features."""

    def __init__(self, din: int, heads: int, head_dim: int, fused: bool, rngs: nnx.Rngs):
        self.heads, self.head_dim, self.fused = heads, head_dim, fused
        w = jax.random.normal(rngs.params(), (din, heads * head_dim)) / np.sqrt(din)
        self.w = nnx.Param(w, scale=1.0)

    def __call__(self, x):
        y = x @ self.w[...] * self.w.get_metadata()["scale"]
        if self.fused:
            gate, up = jnp.split(y, 2, axis=-1)
            return jax.nn.silu(gate) * up
        return y.reshape(*x.shape[:-1], self.heads, self.head_dim)


class HeadsBlock(nnx.Module):
    def __init__(self, fused: bool, rngs: nnx.Rngs):
        self.up = HeadProjection(8, 4, 4, fused, rngs)
        self.down = nnx.Linear(8 if fused else 16, 8, rngs=rngs)

    def __call__(self, x):
        y = self.up(x)
        return x + self.down(y if y.ndim == x.ndim else y.reshape(*x.shape[:-1], -1))


@pytest.mark.parametrize("fused", [False, True], ids=["heads", "gate-up"])
def test_published_column_layer_forms_train_as_on_one_device(fused):
    """Neither is refused: the split axis is found from the output's shape (the heads axis, not the last),
    and a fused gate/up's output is a contiguous slice (its groups combined)."""

    def make():
        model = Net("per_feature", nnx.Rngs(0))
        model.blocks = nnx.List([HeadsBlock(fused, nnx.Rngs(2))])
        return model

    plan = tp_plan.TPPlan(
        {"blocks/*/up": tp_plan.column(groups=2 if fused else 1), "blocks/*/down": tp_plan.row()},
        divide={} if fused else {"blocks/*/up": ("heads",)},
    )
    want = train_single_device(make, loss_fn, BATCHES, optax.sgd(0.1))
    assert_same_training(train(prepare_on_dp4_tp2(make(), plan), BATCHES), want)
