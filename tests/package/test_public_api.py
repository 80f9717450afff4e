"""The package's public face: `from jaxdist import ...` gives the strategies, and every strategy's
`prepare` returns a run that meets the written contract (`jaxdist.Run`)."""

import importlib

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh

import jaxdist
from jaxdist import DDP, FSDP, Parallel, Pipelined, Run, TPPlan, TrainState, Units, comm
from jaxdist.tp import plan as plans


class Block(nnx.Module):
    def __init__(self, rngs):
        self.up, self.down = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.relu(self.up(x)))


class Model(nnx.Module):
    def __init__(self, rngs):
        self.inp, self.out = nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 1, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])

    def __call__(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def embed(model, batch):
    return model.inp(batch["x"])


def head_loss(model, x, batch):
    return ((model.out(x) - batch["y"]) ** 2).mean()


def loss_fn(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


UNITS = Units(embed=embed, head_loss=head_loss)
BATCH = {"x": np.ones((8, 4), np.float32), "y": np.zeros((8, 1), np.float32)}
PLAN = TPPlan({"blocks/*/up": plans.column(), "blocks/*/down": plans.row()})


def test_the_public_names_are_the_strategies_and_the_contract():
    assert comm is jaxdist.comm
    assert {"DDP", "FSDP", "Parallel", "Pipelined", "Units", "TPPlan", "Run", "TrainState", "comm"} <= set(
        jaxdist.__all__
    )
    assert importlib.import_module("jaxdist.ddp").DDP is DDP
    assert importlib.import_module("jaxdist.engine").Parallel is Parallel
    assert jaxdist.ddp.DDP is DDP and jaxdist.engine.Parallel is Parallel and jaxdist.engine.FSDP is FSDP
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        jaxdist.NoSuchThing  # noqa: B018


@pytest.mark.parametrize("package", ["core", "ddp", "engine", "tp", "pipeline", "models", "train.data"])
def test_each_subpackage_lists_its_public_names(package):
    module = importlib.import_module(f"jaxdist.{package}")
    assert module.__doc__ and module.__all__
    for name in module.__all__:
        assert getattr(module, name) is not None


@pytest.mark.parametrize(
    ("old", "new"), [("jaxdist.tp_plan", "jaxdist.tp.plan"), ("jaxdist.train.gpt", "jaxdist.models.gpt")]
)
def test_an_old_module_path_names_its_new_one(old, new):
    with pytest.raises(ModuleNotFoundError, match=f"^{old} moved to {new}: import it from there$"):
        importlib.import_module(old)
    assert importlib.import_module(new)


@pytest.mark.parametrize(
    "prepare",
    [
        lambda: DDP(cpu_mesh((8,), ("dp",))).prepare(Model(nnx.Rngs(0)), optax.sgd(0.1), loss_fn, BATCH),
        lambda: FSDP(cpu_mesh((8,), ("fsdp",))).prepare(Model(nnx.Rngs(0)), optax.sgd(0.1), UNITS, BATCH),
        lambda: Parallel(cpu_mesh((4, 2), ("dp", "tp")), plan=PLAN).prepare(
            Model(nnx.Rngs(0)), optax.sgd(0.1), UNITS, BATCH
        ),
        lambda: Pipelined(cpu_mesh((2, 4), ("pp", "dp")), microbatches=1).prepare(
            Model(nnx.Rngs(0)), optax.sgd(0.1), UNITS, BATCH
        ),
    ],
    ids=["ddp", "fsdp", "dp_tp", "pipeline"],
)
def test_every_strategy_returns_a_run_that_meets_the_contract(prepare):
    run = prepare()
    assert isinstance(run, Run)
    assert isinstance(run.state, TrainState)
    params = run.params(run.state)
    params = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
    initial = nnx.to_pure_dict(nnx.state(Model(nnx.Rngs(0)), nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, params, initial)
