"""A model whose every module (blocks included) stores a plain, mutable dataclass config (unhashable, as
published NNX families do) trains under the unit engine's paths that trace a block once per kind: tensor
parallelism (which gradients to sum over tp, decided per block definition at prepare), FSDP with
`remat=False` (the residuals of the weights alone, traced per block definition at the first step) and
the pipeline (its blocks must be identical). Each is compared with a single-device optax run (SGD with
momentum: losses, gradient norm and final parameters)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.reference import train_single_device

from jaxdist.engine.fsdp import FSDP
from jaxdist.engine.run import Parallel, Units
from jaxdist.pipeline.run import Pipelined
from jaxdist.tp import plan as tp_plan

STEPS = 2


@dataclasses.dataclass  # not frozen: instances are unhashable
class ModelConfig:
    vocab: int = 16
    dim: int = 8
    hidden: int = 16
    layers: int = 2


class Linear(nnx.Linear):
    """A subclassed layer keeping the config, as published models' layers do."""

    def __init__(self, cfg: ModelConfig, n_in: int, n_out: int, rngs: nnx.Rngs):
        super().__init__(n_in, n_out, kernel_init=nnx.initializers.normal(0.3), rngs=rngs)
        self.cfg = cfg


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.norm = nnx.LayerNorm(cfg.dim, rngs=rngs)
        self.up = Linear(cfg, cfg.dim, cfg.hidden, rngs)
        self.down = Linear(cfg, cfg.hidden, cfg.dim, rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(self.norm(x))))


class Model(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.dim, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.head = Linear(cfg, cfg.dim, cfg.vocab, rngs)


def embed(model, batch):
    return model.embed(batch["tokens"][:, :-1])


def head_loss(model, x, batch):
    logits = model.head(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()


def loss_fn(model, batch):
    x = embed(model, batch)
    for block in model.blocks:
        x = block(x)
    return head_loss(model, x, batch)


UNITS = Units(embed, head_loss)
PLAN = tp_plan.TPPlan({"blocks/*/up": tp_plan.column(), "blocks/*/down": tp_plan.row()})


def make_model():
    return Model(ModelConfig(), nnx.Rngs(0))


def optimizer():
    return optax.sgd(0.2, momentum=0.9)


def batches():
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, 16, (8, 6)).astype(np.int32)} for _ in range(STEPS)]


@pytest.fixture(scope="module")
def reference():
    """Single-device optax: losses, gradient norms and final parameters."""
    losses, params, norms, _ = train_single_device(make_model, loss_fn, batches(), optimizer())
    return losses, norms, params


STRATEGIES = {
    "tp": lambda: Parallel(cpu_mesh((4, 2), ("dp", "tp")), plan=PLAN),
    "fsdp-remat-false": lambda: FSDP(cpu_mesh((8,), ("fsdp",)), remat=False),
    "hsdp-tp-remat-false": lambda: Parallel(cpu_mesh((2, 2, 2), ("dp", "fsdp", "tp")), plan=PLAN, remat=False),
    "pipeline": lambda: Pipelined(cpu_mesh((2, 4), ("pp", "dp")), microbatches=2),
}


# TP alone is slow: hsdp-tp-remat-false binds the same plan's blocks under tp
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow if n == "tp" else ()) for n in STRATEGIES])
def test_trains_like_one_device(name, reference):
    run = STRATEGIES[name]().prepare(make_model(), optimizer(), UNITS, batches()[0])
    state, losses, norms = run.state, [], []
    for batch in batches():
        state, metrics = run.step(state, batch)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    ref_losses, ref_norms, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    params = nnx.to_pure_dict(run.params(state))
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)
