"""Gradients of parameters replicated over tp, through the unit engine, against one device.

A replicated parameter needs its gradient summed over tp exactly where it acts on values that
differ per tp rank (local heads, a sequence chunk) and must not be summed where every rank
computes the whole gradient (on activations replicated over tp, or gathered). The model below has
both kinds: q/k RMSNorm scales on the local heads after column projections, a norm before them,
and in the head a norm on the (sequence-split) activations before a gathered column layer and a
logit scale after it. SGD (a gradient scale error shows as a parameter error) over a (dp, tp) =
(4, 2) mesh, with and without sequence parallelism, against a single-device run.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.reference import LOSS_RTOL, assert_params_close, train_single_device
from support.runs import engine_run

from jaxdist.engine.run import Parallel, Units
from jaxdist.tp import plan as tp_plan

D_IN, D, HEADS, D_OUT, SEQ, BATCH = 5, 16, 4, 6, 8, 8


class QKNormAttention(nnx.Module):
    """Pre-norm attention whose q and k heads are RMS-normalized per head (a replicated scale of
    the head width, applied to each rank's own heads under tp)."""

    def __init__(self, rngs: nnx.Rngs, gain_on_both: bool = False):
        self.n_heads = HEADS
        self.norm = nnx.RMSNorm(D, rngs=rngs)
        self.q, self.k, self.v, self.o = (nnx.Linear(D, D, rngs=rngs) for _ in range(4))
        self.q_norm = nnx.RMSNorm(D // HEADS, rngs=rngs)
        self.k_norm = nnx.RMSNorm(D // HEADS, rngs=rngs)
        self.gain = nnx.Param(jnp.full((), 1.5)) if gain_on_both else None

    def __call__(self, x):
        h = self.norm(x)
        if self.gain is not None:  # one replicated scalar on replicated and on tp-split values
            h = h * self.gain[...]

        def heads(a):
            return a.reshape(*a.shape[:-1], self.n_heads, -1)

        q, k, v = self.q_norm(heads(self.q(h))), self.k_norm(heads(self.k(h))), heads(self.v(h))
        if self.gain is not None:
            q = q * self.gain[...]
        weights = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        return x + self.o(out.reshape(*out.shape[:-2], -1))


class LogitScale(nnx.Module):
    def __init__(self, n: int):
        self.scale = nnx.Param(jnp.linspace(0.5, 1.5, n))

    def __call__(self, logits):
        return logits * self.scale[...]


class QKNormModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, layers: int = 2, gain_on_both: bool = False):
        self.inp = nnx.Linear(D_IN, D, rngs=rngs)
        self.layers = nnx.List([QKNormAttention(rngs, gain_on_both) for _ in range(layers)])
        self.final_norm = nnx.RMSNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, D_OUT, rngs=rngs)
        self.logit_scale = LogitScale(D_OUT)

    def __call__(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return head_out(self, x)


def head_out(model, x):
    return model.logit_scale(model.head(model.final_norm(x)))


PLAN = tp_plan.TPPlan(
    {
        "layers/*/q": tp_plan.column(),
        "layers/*/k": tp_plan.column(),
        "layers/*/v": tp_plan.column(),
        "layers/*/o": tp_plan.row(),
        "head": tp_plan.column(gather_output=True),  # the logit scale then acts on gathered logits
    },
    divide={"layers/*": ("n_heads",)},
)
UNITS = Units(
    embed=lambda m, b: m.inp(b["x"]),
    head_loss=lambda m, x, b: jnp.mean((head_out(m, x) - b["y"]) ** 2),
    blocks="layers",
)


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def batches(n, seed=3):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(BATCH, SEQ, D_IN)).astype(np.float32),
            "y": rng.normal(size=(BATCH, SEQ, D_OUT)).astype(np.float32),
        }
        for _ in range(n)
    ]


SEQPAR = {
    "": {},
    "seqpar-batch": {"sequence_parallel": True},
    "seqpar-seq": {"sequence_parallel": True, "sequence_dim": 1},
}


def make_qk_norm_model():
    return QKNormModel(nnx.Rngs(0))


@pytest.fixture(scope="module")
def reference():
    """The single-device SGD run every sequence-parallel setting is compared with, trained once."""
    return train_single_device(make_qk_norm_model, loss_fn, batches(2), optax.sgd(0.3))


# without sequence parallelism only (a) applies, and both sequence-parallel runs check it too: slow
@pytest.mark.parametrize("seqpar", [pytest.param(name, marks=pytest.mark.slow if not name else ()) for name in SEQPAR])
def test_replicated_parameters_on_split_or_gathered_activations_get_the_single_device_gradient(reference, seqpar):
    """(a) the q/k norm scales act on each rank's heads: their gradient is summed over tp;
    (b) under sequence parallelism the logit scale acts on logits gathered over the sequence (every
    rank computes its whole gradient: not summed) while the final norm acts on the rank's chunk
    (summed). SGD parameters and the gradient norm match one device."""
    ref_losses, ref_params, ref_norms, _ = reference
    strategy = Parallel(cpu_mesh((4, 2), ("dp", "tp")), plan=PLAN, **SEQPAR[seqpar])
    losses, params, run, _, metrics = engine_run(strategy, make_qk_norm_model, UNITS, batches(2), optax.sgd(0.3))
    if seqpar:  # the batch's leading dimension unless told otherwise
        assert run.sequence_dim == (1 if seqpar == "seqpar-seq" else 0)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    np.testing.assert_allclose([float(m["grad_norm"]) for m in metrics], ref_norms, rtol=1e-5)
    assert_params_close(params, ref_params, atol=1e-5)


def test_a_replicated_parameter_on_replicated_and_split_values_at_once_raises():
    """One scalar gain on the normalized (replicated) activations and on the local q heads: its
    gradient is one part whole and one part per rank, which no single sum over tp makes right."""

    def make():
        return QKNormModel(nnx.Rngs(0), layers=1, gain_on_both=True)

    strategy = Parallel(cpu_mesh((1, 2), ("dp", "tp")), plan=PLAN)
    with pytest.raises(ValueError, match=r"layers/0/gain.*tp"):
        strategy.prepare(make(), optax.sgd(0.1), UNITS, batches(1)[0])


def test_a_loss_that_differs_per_tp_rank_raises():
    """Under sequence parallelism a head that averages its sequence chunk before any tp layer has
    a loss of its own on each tp rank."""
    units = dataclasses.replace(UNITS, head_loss=lambda m, x, b: jnp.mean(m.final_norm(x) ** 2))
    strategy = Parallel(cpu_mesh((1, 2), ("dp", "tp")), plan=PLAN, sequence_parallel=True)
    with pytest.raises(ValueError, match="the head returns a value that differs per tp rank"):
        strategy.prepare(QKNormModel(nnx.Rngs(0), layers=1), optax.sgd(0.1), units, batches(1)[0])


def test_sequence_parallel_falls_back_to_the_sequence_when_tp_does_not_divide_the_rows():
    data = [{k: v[:1] for k, v in b.items()} for b in batches(1)]  # one row per data rank, 8 tokens
    strategy = Parallel(cpu_mesh((1, 2), ("dp", "tp")), plan=PLAN, sequence_parallel=True)
    run = strategy.prepare(QKNormModel(nnx.Rngs(0), layers=1), optax.sgd(0.1), UNITS, data[0])
    assert run.sequence_dim == 1


@pytest.mark.parametrize(
    "options, match",
    [
        ({}, r"dimension 1 of the activations \(1, 7, 16\) over tp=2"),  # neither batch 1 nor 7 tokens divide
        ({"sequence_dim": 2}, r"dimension 2 .*\(not the last, the features\)"),
        ({"sequence_dim": 1, "sequence_parallel": False}, r"sequence_dim only applies with sequence_parallel=True"),
    ],
)
def test_sequence_parallel_on_a_dimension_tp_does_not_divide_raises(options, match):
    data = [{k: v[:1, :7] for k, v in b.items()} for b in batches(1)]
    with pytest.raises(ValueError, match=match):
        strategy = Parallel(cpu_mesh((1, 2), ("dp", "tp")), plan=PLAN, **{"sequence_parallel": True, **options})
        strategy.prepare(QKNormModel(nnx.Rngs(0), layers=1), optax.sgd(0.1), UNITS, data[0])
