"""A row layer of the model's own type runs its own call on each tp rank's slices, and the ranks' results
are summed after it: a bias named otherwise than `bias` was added tp times (dp4 x tp2: first loss 2.142
against one device's 1.935), an activation inside the layer applied to partial sums. Such layers are
refused at `prepare`, naming what the call does; linear ones (a guarded `bias`, a gain) train as on one
device."""

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


class Dense(nnx.Module):
    """A hand-written dense layer, `w` [in, out], in one of the forms the tests name."""

    def __init__(self, din: int, dout: int, form: str, rngs: nnx.Rngs):
        self.form = form
        self.w = nnx.Param(jax.random.normal(rngs.params(), (din, dout)) / np.sqrt(din), scale=1.0)
        name = "b" if form in ("b", "use_bias") else "bias"
        setattr(self, name, nnx.Param(jnp.full((dout,), 0.3)))
        self.gain = nnx.Param(jnp.array(1.3))
        self.use_bias = True

    def _with_bias(self, y):  # a helper reading the bias: it must see the view's (none)
        return y + self.bias[...] if self.bias is not None else y

    def __call__(self, x):
        y = x @ self.w[...] * self.w.get_metadata()["scale"]  # its metadata read: the check keeps it
        if self.form == "b":
            return y + self.b[...]
        if self.form == "gelu":
            return jax.nn.gelu(y)
        if self.form == "unguarded":
            return y + self.bias[...]
        if self.form == "use_bias":  # a flag jaxdist's view sets off only where it hides a bias named bias
            return y + self.b[...] if self.use_bias else y
        if self.form == "loop":
            return jax.lax.fori_loop(0, 2, lambda i, v: jax.nn.relu(v), y)
        kept = jnp.arange(y.shape[-1]) % 3 != 0  # "linear": an output mask, a gain, the bias in a helper
        return self._with_bias(jnp.where(kept, y, 0.0) * self.gain[...])


def Net(form: str, rngs: nnx.Rngs):
    return mlp_net(lambda r: nnx.Linear(8, 16, rngs=r), lambda r: Dense(16, 8, form, r), rngs)


def prepare(form: str):
    return prepare_on_dp4_tp2(Net(form, nnx.Rngs(0)))


@pytest.mark.parametrize(
    "form, said",
    [
        ("b", "it adds the parameter 'b' to the product"),
        ("gelu", "applies integer_pow, which is not linear, to the product"),
        ("unguarded", "its call fails where its `bias` is None"),
        ("use_bias", "it adds the parameter 'b' to the product"),
        ("loop", "applies max, which is not linear, to the product"),
    ],
)
def test_a_row_layer_whose_call_is_not_linear_in_its_weight_is_refused_naming_what_it_does(form, said):
    with pytest.raises(ValueError, match="blocks/0/down \\(Dense\\) is row parallel") as e:
        prepare(form)
    assert said in str(e.value), str(e.value)


def test_a_row_layer_linear_in_its_weight_with_a_mask_a_gain_and_its_bias_in_a_helper_trains_as_on_one_device():
    want = train_single_device(lambda: Net("linear", nnx.Rngs(0)), loss_fn, BATCHES, optax.sgd(0.1))
    assert_same_training(train(prepare("linear"), BATCHES), want)
