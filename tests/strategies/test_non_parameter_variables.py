"""Non-parameter variables of other kinds than dropout keys and float BatchNorm statistics: an
integer batch statistic (a count of batches seen, as PyTorch's `num_batches_tracked`), a float
statistic that is linear in the batch (an EMA of the input mean: the mean of the ranks' local
statistics is then exactly the single device's), and a bool constant, in the outer model and in
the blocks, under DDP, ZeRO-1 and the unit engine, against one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.models import odd_batches
from support.reference import assert_same_training
from support.runs import train

from jaxdist.ddp.run import DDP
from jaxdist.engine.run import Parallel, Units


class Tracked(nnx.Module):
    """A linear layer that counts its calls and keeps an EMA of its input's mean."""

    def __init__(self, d_in: int, d_out: int, rngs: nnx.Rngs):
        self.lin = nnx.Linear(d_in, d_out, rngs=rngs)
        self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))
        self.ema = nnx.BatchStat(jnp.zeros((d_in,), jnp.float32))
        self.on = nnx.Variable(jnp.array(True))

    def __call__(self, x):
        self.count[...] = self.count[...] + 1
        self.ema[...] = 0.9 * self.ema[...] + 0.1 * x.mean(0)
        return jnp.where(self.on[...], self.lin(x), 0.0)


class TrackedMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.inp = Tracked(5, 8, rngs)
        self.layers = nnx.List([Tracked(8, 8, rngs) for _ in range(2)])
        self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return self.out(x)


def loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


UNITS = Units(
    embed=lambda m, b: m.inp(b["x"]),
    head_loss=lambda m, x, b: jnp.mean((m.out(x) - b["y"]) ** 2),
    blocks="layers",
    block_call=lambda blk, x, b: jnp.tanh(blk(x)),
)


def reference_with_state(batches, optimizer):
    """One device: `(losses, params, grad norms)` and the variables after the last step, each step's
    forward updating them (on that step's parameters)."""
    graphdef, params, rest = nnx.split(TrackedMLP(nnx.Rngs(0)), nnx.Param, ...)
    leaves, rest_def = jax.tree.flatten(rest)
    pure = nnx.to_pure_dict(params)
    opt_state = optimizer.init(pure)

    @jax.jit
    def step(p, leaves, s, batch):
        def forward(p):
            model = nnx.merge(graphdef, p, jax.tree.unflatten(rest_def, leaves))
            return loss(model, batch), jax.tree.leaves(nnx.split(model, nnx.Param, ...)[2])

        (value, leaves), g = jax.value_and_grad(forward, has_aux=True)(p)
        updates, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, updates), leaves, s, value, optax.tree.norm(g)

    losses, norms = [], []
    for batch in batches:
        pure, leaves, opt_state, value, norm = step(pure, leaves, opt_state, batch)
        losses.append(float(value))
        norms.append(float(norm))
    stats = nnx.to_pure_dict(
        nnx.state(nnx.merge(graphdef, params, jax.tree.unflatten(rest_def, leaves)), nnx.BatchStat)
    )
    return (losses, pure, norms), stats


# DDP and FSDP alone are slow: the fast run trains ZeRO-1 (DDP's class and per-device step) and HSDP (FSDP's
# units over an fsdp axis, beside a dp axis)
@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(lambda: DDP(cpu_mesh((8,), ("dp",))), marks=pytest.mark.slow),
        lambda: DDP(cpu_mesh((8,), ("dp",)), zero1=True),
        pytest.param(lambda: Parallel(cpu_mesh((8,), ("fsdp",))), marks=pytest.mark.slow),
        lambda: Parallel(cpu_mesh((4, 2), ("dp", "fsdp")), remat=False),
    ],
    ids=["ddp", "zero1", "fsdp", "hsdp-keep"],
)
def test_integer_and_linear_batch_statistics_train_as_on_one_device(strategy):
    data = odd_batches(3)
    opt = optax.sgd(0.2, momentum=0.9)
    want, want_stats = reference_with_state(data, opt)
    s = strategy()
    run = s.prepare(TrackedMLP(nnx.Rngs(0)), opt, loss if isinstance(s, DDP) else UNITS, data[0])
    got = train(run, data)
    assert_same_training(got, want)
    stats = nnx.to_pure_dict(nnx.state(run.model(got[3]), nnx.BatchStat))
    for (path, x), (_, y) in zip(
        jax.tree_util.tree_leaves_with_path(stats), jax.tree_util.tree_leaves_with_path(want_stats), strict=True
    ):
        assert np.asarray(x).dtype == np.asarray(y).dtype, path
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7, err_msg=str(path))
    assert int(stats["layers"][1]["count"]) == 3


def prepared(kind: str, optimizer, batch):
    model = TrackedMLP(nnx.Rngs(0))
    if kind == "zero1":
        return DDP(cpu_mesh((8,), ("dp",)), zero1=True).prepare(model, optimizer, loss, batch)
    if kind == "ddp":
        return DDP(cpu_mesh((8,), ("dp",))).prepare(model, optimizer, loss, batch)
    if kind == "hsdp":
        return Parallel(cpu_mesh((2, 4), ("dp", "fsdp"))).prepare(model, optimizer, UNITS, batch)
    return Parallel(cpu_mesh((8,), ("fsdp",))).prepare(model, optimizer, UNITS, batch)


@pytest.mark.parametrize(("source", "target"), [("zero1", "hsdp"), ("fsdp", "ddp")])
def test_the_canonical_state_moves_statistics_and_momentum_across_layouts(source, target):
    """One step on `source`, the canonical state onto `target`, two more steps: the single device's
    three steps (parameters, momentum through them, the integer count and the EMA)."""
    data = odd_batches(3)
    opt = optax.sgd(0.2, momentum=0.9)
    (want_losses, want_params, _), want_stats = reference_with_state(data, opt)
    first, then = prepared(source, opt, data[0]), prepared(target, opt, data[0])
    state, _ = first.step(first.state, data[0])
    state = then.from_canonical(first.canonical(state))
    losses = []
    for batch in data[1:]:
        state, metrics = then.step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, want_losses[1:], rtol=5e-6)
    params = nnx.to_pure_dict(then.params(state))
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    stats = nnx.to_pure_dict(nnx.state(then.model(state), nnx.BatchStat))
    for x, y in zip(jax.tree.leaves(stats), jax.tree.leaves(want_stats), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
    assert int(stats["inp"]["count"]) == 3
