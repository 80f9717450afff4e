"""A model that states its own sharding, as published ones do, trains under every strategy that runs it
per device (inside `shard_map`): its parameters come from `nnx.with_partitioning` (made under the
mesh and `nnx.logical_axis_rules`, flax's eager sharding), and its `__call__` constrains activations
with `jax.lax.with_sharding_constraint` (a PartitionSpec and a NamedSharding), flax's logical
constraints, `out_sharding=` of an `nnx.Linear` call and of `jnp.einsum`, and `jax.sharding.reshard`.
Per device the strategy has placed every value already, so these annotations are dropped there: each
run equals a single-device optax run of the same model without them (SGD with momentum: losses,
gradient norm, final parameters)."""

import dataclasses

import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from support.meshes import cpu_mesh
from support.reference import train_single_device

from jaxdist.ddp.run import DDP
from jaxdist.engine.fsdp import FSDP
from jaxdist.engine.run import Parallel, Units
from jaxdist.pipeline.run import Pipelined
from jaxdist.tp import plan as tp_plan

STEPS = 2
INIT = nnx.initializers.normal(0.3)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 16
    dim: int = 8
    hidden: int = 16
    layers: int = 2
    mesh: jax.sharding.Mesh | None = None  # None: no annotations (the reference)

    @property
    def batch(self):
        """The mesh axes the batch dimension is split over (the model's own view of the mesh)."""
        names = tuple(a for a in self.mesh.axis_names if a in ("dp", "fsdp"))
        return names[0] if len(names) == 1 else names

    @property
    def model_axis(self):
        return "tp" if "tp" in self.mesh.axis_names else None


def logical_rules(mesh) -> tuple:
    cfg = ModelConfig(mesh=mesh)
    return (("batch", cfg.batch), ("seq", None), ("embed", None), ("vocab", None), ("mlp", cfg.model_axis))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.norm = nnx.LayerNorm(cfg.dim, rngs=rngs)
        self.up = nnx.Linear(cfg.dim, cfg.hidden, kernel_init=nnx.with_partitioning(INIT, ("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(
            cfg.hidden, cfg.dim, kernel_init=nnx.with_partitioning(INIT, ("mlp", "embed")), rngs=rngs
        )

    def __call__(self, x):
        cfg = self.cfg
        if cfg.mesh is None:
            return x + self.down(jnp.tanh(self.up(self.norm(x))))
        h = self.up(self.norm(x), out_sharding=P(cfg.batch, None, cfg.model_axis))
        h = jax.lax.with_sharding_constraint(jnp.tanh(h), P(cfg.batch, None, cfg.model_axis))
        h = flax.linen.with_logical_constraint(h, ("batch", "seq", "mlp"))
        y = x + self.down(h)
        y = jax.lax.with_sharding_constraint(y, NamedSharding(cfg.mesh, P(cfg.batch)))
        return jax.sharding.reshard(y, P(cfg.batch))


class Model(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab, cfg.dim, embedding_init=nnx.with_partitioning(INIT, ("vocab", "embed")), rngs=rngs
        )
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.head = nnx.Linear(
            cfg.dim, cfg.vocab, kernel_init=nnx.with_partitioning(INIT, ("embed", "vocab")), rngs=rngs
        )


def embed(model, batch):
    x = model.embed(batch["tokens"][:, :-1])
    if model.cfg.mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, P(model.cfg.batch))


def head_loss(model, x, batch):
    if model.cfg.mesh is None:
        logits = model.head(x)
    else:
        kernel = model.head.kernel[...]
        logits = jnp.einsum("btd,dv->btv", x, kernel, out_sharding=P(model.cfg.batch)) + model.head.bias[...]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()


def loss_fn(model, batch):
    x = embed(model, batch)
    for block in model.blocks:
        x = block(x)
    return head_loss(model, x, batch)


UNITS = Units(embed, head_loss)
PLAN = tp_plan.TPPlan({"blocks/*/up": tp_plan.column(), "blocks/*/down": tp_plan.row()})


def auto(mesh):
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def annotated_model(mesh):
    """The model as its authors build it: under its mesh and logical rules (flax's eager sharding
    places each `with_partitioning` parameter)."""
    with jax.set_mesh(auto(mesh)), nnx.logical_axis_rules(logical_rules(mesh)):
        return Model(ModelConfig(mesh=mesh), nnx.Rngs(0))


def optimizer():
    return optax.sgd(0.2, momentum=0.9)


def batches():
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, 16, (8, 6)).astype(np.int32)} for _ in range(STEPS)]


@pytest.fixture(scope="module")
def reference():
    """Single-device optax on the model without annotations: losses, gradient norms, final parameters."""

    def make():
        with nnx.use_eager_sharding(False):  # one device: no mesh to place the parameters on
            return Model(ModelConfig(), nnx.Rngs(0))

    losses, params, norms, _ = train_single_device(make, loss_fn, batches(), optimizer())
    return losses, norms, params


def mesh_of(shape, names):
    return auto(cpu_mesh(shape, names))


# name: (the mesh, the strategy on it); every mesh axis is manual inside each strategy's step
STRATEGIES = {
    "ddp": (mesh_of((8,), ("dp",)), lambda mesh: DDP(mesh, bucket_size=300)),
    "zero1": (mesh_of((8,), ("dp",)), lambda mesh: DDP(mesh, zero1=True, bucket_size=300)),
    "fsdp": (mesh_of((8,), ("fsdp",)), lambda mesh: FSDP(mesh)),
    "fsdp-remat-false": (mesh_of((8,), ("fsdp",)), lambda mesh: FSDP(mesh, remat=False)),
    "hsdp": (mesh_of((2, 4), ("dp", "fsdp")), lambda mesh: FSDP(mesh, dp_axis="dp")),
    "tp": (mesh_of((4, 2), ("dp", "tp")), lambda mesh: Parallel(mesh, plan=PLAN)),
    "pipeline": (mesh_of((2, 4), ("pp", "dp")), lambda mesh: Pipelined(mesh, microbatches=2)),
}


# ZeRO-1 runs the model in DDP's per-device step and HSDP in FSDP's: both checked in the fast run as ddp and fsdp
SLOW = {"zero1", "hsdp"}


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=pytest.mark.slow if name in SLOW else ()) for name in STRATEGIES]
)
def test_annotated_model_trains_like_one_device(name, reference):
    mesh, make = STRATEGIES[name]
    strategy = make(mesh)
    model = annotated_model(mesh)
    with nnx.logical_axis_rules(logical_rules(mesh)):  # the rules stay on while the model trains
        if isinstance(strategy, DDP):
            run = strategy.prepare(model, optimizer(), loss_fn, batches()[0])
        else:
            run = strategy.prepare(model, optimizer(), UNITS, batches()[0])
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


def test_annotations_apply_again_outside_the_step():
    """Dropped only while a strategy runs the model per device: afterwards a constraint naming a manual
    axis inside a plain `shard_map` is refused by JAX as before (nothing is left patched)."""
    mesh = mesh_of((8,), ("dp",))
    run = DDP(mesh).prepare(annotated_model(mesh), optimizer(), loss_fn, batches()[0])
    run.step(run.state, batches()[0])
    body = jax.shard_map(
        lambda x: jax.lax.with_sharding_constraint(x, P("dp")), mesh=mesh, in_specs=P("dp"), out_specs=P("dp")
    )
    with pytest.raises(ValueError, match="Auto axes|manual"):
        jax.jit(body)(jnp.ones((8, 2)))
