"""Layers stacked with `nnx.vmap` holding non-parameter variables (a frozen LoRA base weight, a constant
table): every engine strategy failed at the first step inside JAX (the constants kept the model's mesh,
which the per-device program may not close over). They train as on one device now, and constants too
large to compile in are refused at `prepare`, naming the list form."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.reference import assert_same_training, train_single_device
from support.runs import train

from jaxdist.engine import units as units_lib
from jaxdist.engine.fsdp import FSDP
from jaxdist.engine.run import Parallel, Units

D, LAYERS = 8, 2


class Frozen(nnx.Variable):
    pass


class Layer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(D, D, rngs=rngs)
        self.base = Frozen(jax.random.normal(rngs.params(), (D, D)) / np.sqrt(D))  # LoRA's frozen base
        self.table = Frozen(jax.random.normal(rngs.params(), (D,)))

    def __call__(self, x):
        return x + jnp.tanh(self.lin(x) + x @ self.base[...] + self.table[...])


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.inp = nnx.Linear(6, D, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Layer(rngs)

        self.layers = make(rngs)
        self.out = nnx.Linear(D, 4, rngs=rngs)


def head_loss(model, h, batch):
    return jnp.mean((model.out(h) - batch["y"]) ** 2)


def loss_fn(model, batch):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def through(h, layer):
        return layer(h)

    return head_loss(model, through(model.inp(batch["x"]), model.layers), batch)


UNITS = Units(embed=lambda m, b: m.inp(b["x"]), head_loss=head_loss, blocks="layers", stacked=True)
RNG = np.random.default_rng(0)
BATCHES = [{"x": RNG.normal(size=(8, 6)).astype(np.float32), "y": RNG.normal(size=(8, 4)).astype(np.float32)}] * 2


@pytest.mark.parametrize("strategy", ["fsdp4", "dp2xfsdp2"])
def test_stacked_layers_with_constants_train_as_on_one_device(strategy):
    if strategy == "fsdp4":
        make = FSDP(cpu_mesh((4,), ("fsdp",)))
    else:
        make = Parallel(cpu_mesh((2, 2), ("dp", "fsdp")))
    run = make.prepare(Net(nnx.Rngs(0)), optax.sgd(0.1), UNITS, BATCHES[0])
    want = train_single_device(lambda: Net(nnx.Rngs(0)), loss_fn, BATCHES, optax.sgd(0.1))
    assert_same_training(train(run, BATCHES), want)


def test_stacked_constants_too_large_to_compile_in_are_refused_naming_the_list_form(monkeypatch):
    monkeypatch.setattr(units_lib, "STACKED_CONSTANT_BYTES", 256)  # the model's are 2 x (64 + 8) x 4 bytes
    with pytest.raises(ValueError, match="hold 0 MiB of non-parameter variables .*Units\\(stacked=False\\)"):
        FSDP(cpu_mesh((4,), ("fsdp",))).prepare(Net(nnx.Rngs(0)), optax.sgd(0.1), UNITS, BATCHES[0])
