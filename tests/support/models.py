"""Models the strategy tests train, their losses, units, plans and batches.

Each is small (a compile of seconds on CPU) and unlike the shipped GPT in some way a strategy must
handle: tanh MLPs (`MLP`), odd widths no data axis divides (`ResMLP`, `OddMLP`), scalar and size-1
parameters (`OddMLP`), non-parameter variables, dropout and BatchNorm (`Net`), layers the loss never
reads (`WithUnusedLayers`).
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdist.engine.run import Units
from jaxdist.models.gpt import GPT, GPTConfig, next_token_loss
from jaxdist.tp import plan as tp_plan

# -- the GPT ------------------------------------------------------------------------------------

GPT_CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)


def gpt_batches(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, 64, (16, 17)).astype(np.int32)} for _ in range(n)]


# -- tanh MLPs ------------------------------------------------------------------------------------


class MLP(nnx.Module):
    def __init__(self, n_layers: int, dim: int, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(dim, dim, precision="highest", rngs=rngs) for _ in range(n_layers)])

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


def mlp_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


class WithUnusedLayers(nnx.Module):
    """A used layer, then layers the loss never reads (a frozen or not yet used head, say)."""

    def __init__(self, rngs: nnx.Rngs):
        self.used = nnx.Linear(32, 32, rngs=rngs)
        self.unused = nnx.List([nnx.Linear(32, 32, rngs=rngs) for _ in range(3)])

    def __call__(self, x):
        return self.used(x)


TWO_HEAD_GPT_CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2)


def make_case(name: str, n_batches: int, batch_size: int = 16, seed: int = 0):
    """`(make_model, loss_fn, batches)`: the 2-head GPT (`"gpt"`) or a 4-layer tanh MLP."""
    rng = np.random.default_rng(seed)
    if name == "gpt":
        batches = [{"tokens": rng.integers(0, 64, (batch_size, 17)).astype(np.int32)} for _ in range(n_batches)]
        return (lambda: GPT(TWO_HEAD_GPT_CFG, nnx.Rngs(0))), next_token_loss, batches
    batches = [
        {
            "x": rng.normal(size=(batch_size, 32)).astype(np.float32),
            "y": rng.normal(size=(batch_size, 32)).astype(np.float32),
        }
        for _ in range(n_batches)
    ]
    return (lambda: MLP(4, 32, nnx.Rngs(0))), mlp_loss, batches


# -- a residual MLP of odd widths, with its plan and units ------------------------------------------


class ResBlock(nnx.Module):
    def __init__(self, d: int, f: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, f, rngs=rngs)
        self.down = nnx.Linear(f, d, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.relu(self.up(self.norm(x))))


class ResMLP(nnx.Module):
    """Odd input and output widths: some parameters cannot be split over the data axes."""

    def __init__(self, rngs: nnx.Rngs, d_in: int = 5, d: int = 16, f: int = 24, d_out: int = 6, layers: int = 3):
        self.inp = nnx.Linear(d_in, d, rngs=rngs)
        self.layers = nnx.List([ResBlock(d, f, rngs) for _ in range(layers)])
        self.out = nnx.Linear(d, d_out, rngs=rngs)

    def __call__(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


MLP_PLAN = tp_plan.TPPlan(
    {"layers/*/up": tp_plan.column(), "layers/*/down": tp_plan.row(), "out": tp_plan.column(gather_output=True)}
)


MLP_UNITS = Units(
    embed=lambda m, b: m.inp(b["x"]),
    head_loss=lambda m, x, b: jnp.mean((m.out(x) - b["y"]) ** 2),
    blocks="layers",
)


def mlp_batches(n, seed=1):
    rng = np.random.default_rng(seed)
    return [
        {"x": rng.normal(size=(16, 5)).astype(np.float32), "y": rng.normal(size=(16, 6)).astype(np.float32)}
        for _ in range(n)
    ]


# -- an MLP with sizes nothing divides, size-1 biases and scalar parameters -----------------------


class OddBlock(nnx.Module):
    def __init__(self, d: int, hidden: int, rngs: nnx.Rngs):
        self.up = nnx.Linear(d, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, d, rngs=rngs)
        self.gate = nnx.Param(jnp.asarray(0.7, jnp.float32))  # a scalar parameter
        self.shift = nnx.Param(jnp.full((1,), 0.1, jnp.float32))  # a bias of size 1

    def __call__(self, x):
        return x + self.gate * self.down(jnp.tanh(self.up(x))) + self.shift


class OddMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, d_in=5, d=7, hidden=13, d_out=3, layers=3):
        self.inp = nnx.Linear(d_in, d, rngs=rngs)
        self.layers = nnx.List([OddBlock(d, hidden, rngs) for _ in range(layers)])
        self.out = nnx.Linear(d, d_out, rngs=rngs)
        self.temperature = nnx.Param(jnp.asarray(1.3, jnp.float32))

    def __call__(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x) * self.temperature


odd_loss = mlp_loss  # the same mean squared error


ODD_UNITS = Units(
    embed=lambda m, b: m.inp(b["x"]),
    head_loss=lambda m, x, b: jnp.mean((m.out(x) * m.temperature - b["y"]) ** 2),
    blocks="layers",
)


def odd_batches(n, rows=16, d_in=5, d_out=3, seed=3):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(rows, d_in)).astype(np.float32),
            "y": rng.normal(size=(rows, d_out)).astype(np.float32),
        }
        for _ in range(n)
    ]


# -- residual blocks with their own constants, dropout and BatchNorm --------------------------------


NET_IN, NET_DIM, NET_OUT = 8, 16, 4


class NetBlock(nnx.Module):
    """A residual block with a fixed per-block gain (a non-Param variable) and optional BatchNorm/Dropout."""

    def __init__(self, gain: float, rngs: nnx.Rngs, act: bool = True, dropout: float = 0.0, batchnorm: bool = False):
        self.lin = nnx.Linear(NET_DIM, NET_DIM, precision="highest", rngs=rngs)
        self.gain = nnx.Variable(jnp.full((NET_DIM,), gain, jnp.float32))
        self.act = act
        self.norm = nnx.BatchNorm(NET_DIM, momentum=0.5, rngs=rngs) if batchnorm else None
        self.drop = nnx.Dropout(dropout, rngs=rngs) if dropout else None

    def __call__(self, x):
        y = self.lin(x) * self.gain[...]
        if self.norm is not None:
            y = self.norm(y)
        y = jnp.tanh(y) if self.act else y
        if self.drop is not None:
            y = self.drop(y)
        return x + y


class Net(nnx.Module):
    def __init__(self, gains, rngs: nnx.Rngs, acts=None, input_dropout: float = 0.0, **block):
        acts = acts or [True] * len(gains)
        self.inp = nnx.Linear(NET_IN, NET_DIM, precision="highest", rngs=rngs)
        self.drop_in = nnx.Dropout(input_dropout, rngs=rngs) if input_dropout else None
        self.blocks = nnx.List([NetBlock(g, rngs, act=a, **block) for g, a in zip(gains, acts, strict=True)])
        self.out = nnx.Linear(NET_DIM, NET_OUT, precision="highest", rngs=rngs)


def net_embed(model, batch):
    x = model.inp(batch["x"])
    return model.drop_in(x) if model.drop_in is not None else x


def net_head_loss(model, x, batch):
    return jnp.mean((model.out(x) - batch["y"]) ** 2)


def net_loss(model, batch):
    x = net_embed(model, batch)
    for block in model.blocks:
        x = block(x)
    return net_head_loss(model, x, batch)


NET_UNITS = Units(net_embed, net_head_loss)


def net_batches(n: int, batch_size: int = 32, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(batch_size, NET_IN)).astype(np.float32),
            "y": rng.normal(size=(batch_size, NET_OUT)).astype(np.float32),
        }
        for _ in range(n)
    ]


ODD_PLAN = tp_plan.TPPlan({"layers/*/up": tp_plan.column(), "layers/*/down": tp_plan.row()})


# -- a custom model with a weight tied between embed and head -------------------------------------


class TiedModel(nnx.Module):
    """A projection used by the embed and again (transposed) by the head, blocks in between."""

    def __init__(self, rngs: nnx.Rngs, d_in=6, d=8, layers=2):
        self.proj = nnx.Param(jax.random.normal(rngs.params(), (d_in, d)) * 0.3)
        self.layers = nnx.List([OddBlock(d, 12, rngs) for _ in range(layers)])

    def __call__(self, x):
        h = x @ self.proj
        for layer in self.layers:
            h = layer(h)
        return h @ self.proj.T


def tied_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["x"]) ** 2)


TIED_UNITS = Units(
    embed=lambda m, b: b["x"] @ m.proj,
    head_loss=lambda m, x, b: jnp.mean((x @ m.proj.T - b["x"]) ** 2),
    blocks="layers",
)


def tied_batches(n, seed=7):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(16, 6)).astype(np.float32)} for _ in range(n)]


# -- units' loss on the whole model; a float64 model -------------------------------------------------


def whole_model_loss(units: Units):
    """What one device computes for `units`: the embed, every block in order, the head's loss."""

    def loss(model, batch):
        x = units.embed(model, batch)
        for block in getattr(model, units.blocks):
            x = block(x)
        return units.head_loss(model, x, batch)

    return loss


class Block64(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(6, 6, param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.lin(x))


class MLP64(nnx.Module):
    """float64 parameters (under `jax.enable_x64(True)`): batches {"x": [n, 4], "y": [n, 2]}."""

    def __init__(self, rngs: nnx.Rngs):
        self.inp = nnx.Linear(4, 6, param_dtype=jnp.float64, rngs=rngs)
        self.blocks = nnx.List([Block64(rngs) for _ in range(2)])
        self.out = nnx.Linear(6, 2, param_dtype=jnp.float64, rngs=rngs)


UNITS64 = Units(embed=lambda m, b: m.inp(b["x"]), head_loss=lambda m, x, b: jnp.mean((m.out(x) - b["y"]) ** 2))
loss64 = whole_model_loss(UNITS64)
