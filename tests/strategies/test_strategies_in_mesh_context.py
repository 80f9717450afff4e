"""Every strategy prepares, steps, and converts its state inside a user's `jax.set_mesh` context (how JAX
tells users to write sharded code): of the strategy's own mesh with Explicit axes (JAX 0.10's default)
or Auto axes, and of another mesh. Each run is compared with a single-device optax run (SGD with
momentum or AdamW, whose state a sharded `init` builds: losses, gradient norm, final parameters), and
some with the same strategy run outside any context (bitwise: the context must not change the program).

The model, batch shape, strategies and optimizers of ZeRO-1, FSDP and the pipeline are those of the
docs' guides (docs/guides/ddp.md, fsdp.md, pipeline.md): the same programs, compiled once per test run
(tests/docs/test_docs_snippets.py runs the guides' snippets as written, reading them from the cache)."""

import contextlib
import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from support.meshes import cpu_mesh
from support.reference import train_single_device

from jaxdist.ddp.run import DDP
from jaxdist.engine.fsdp import FSDP
from jaxdist.engine.run import Parallel
from jaxdist.models.gpt import GPT, UNITS, GPTConfig, next_token_loss, tp_plan_for
from jaxdist.pipeline.run import Pipelined

STEPS = 2
CFG = GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=2, n_layers=2)


def make_model():
    return GPT(CFG, nnx.Rngs(0))


OPTIMIZERS = {
    "sgd-momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adamw-3e-4": lambda: optax.adamw(3e-4),  # docs/guides/ddp.md's and fsdp.md's
    "adamw-1e-3": lambda: optax.adamw(1e-3),  # docs/guides/pipeline.md's
}


def batches():
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, 16, (8, 9)).astype(np.int32)} for _ in range(STEPS)]


def auto(mesh):
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


# name: (the strategy's mesh shape and names, strategy on a mesh, optimizer)
STRATEGIES = {
    "ddp": (((8,), ("dp",)), lambda mesh: DDP(mesh, bucket_size=2000), "sgd-momentum"),  # several buckets
    "zero1": (((8,), ("dp",)), lambda mesh: DDP(mesh, zero1=True, bucket_size=10_000), "adamw-3e-4"),
    "engine-dp": (((8,), ("dp",)), lambda mesh: Parallel(mesh, zero1=False), "sgd-momentum"),
    "fsdp": (((8,), ("fsdp",)), lambda mesh: FSDP(mesh, buffers=2), "adamw-3e-4"),
    "tp": (((4, 2), ("dp", "tp")), lambda mesh: Parallel(mesh, plan=tp_plan_for(CFG)), "sgd-momentum"),
    "pipeline": (((2, 4), ("pp", "dp")), lambda mesh: Pipelined(mesh, microbatches=2, schedule="1f1b"), "adamw-1e-3"),
}


def strategy_mesh(name: str, axis_types: str):
    (shape, names), _, _ = STRATEGIES[name]
    mesh = cpu_mesh(shape, names)  # Explicit axes
    return auto(mesh) if axis_types == "auto" else mesh


def train(name: str, mesh, context_mesh=None):
    """Prepare and train inside `jax.set_mesh(context_mesh)` (none: outside any context); returns the
    losses, gradient norms, final parameters, and the run and state."""
    _, make, opt = STRATEGIES[name]
    strategy = make(mesh)
    context = jax.set_mesh(context_mesh) if context_mesh is not None else contextlib.nullcontext()
    with context:
        if isinstance(strategy, DDP):
            run = strategy.prepare(make_model(), OPTIMIZERS[opt](), next_token_loss, batches()[0])
        else:
            run = strategy.prepare(make_model(), OPTIMIZERS[opt](), UNITS, batches()[0])
        state, losses, norms = run.state, [], []
        for batch in batches():
            state, metrics = run.step(state, batch)
            losses.append(float(metrics["loss"]))
            norms.append(float(metrics["grad_norm"]))
        params = nnx.to_pure_dict(run.params(state))
    return losses, norms, params, run, state


@pytest.fixture(scope="module")
def references():
    """`get(optimizer)`: single-device optax: losses, gradient norms and final parameters."""

    @functools.cache
    def get(opt: str):
        losses, params, norms, _ = train_single_device(make_model, next_token_loss, batches(), OPTIMIZERS[opt]())
        return losses, norms, params

    return get


def assert_matches_reference(result, reference):
    losses, norms, params = result[:3]
    ref_losses, ref_norms, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)


def other_mesh():
    """A context mesh the strategy does not use: other names and shape, Explicit axes."""
    return cpu_mesh((2, 4), ("a", "b"))


# (strategy, the strategy's mesh axis types, the context: the strategy's own mesh or another)
CASES = [
    *[(name, "explicit", "same") for name in STRATEGIES],
    ("ddp", "auto", "same"),
    ("tp", "auto", "same"),
    ("zero1", "explicit", "other"),
    ("fsdp", "explicit", "other"),
]


@pytest.fixture(scope="module")
def inside_own_mesh():
    """`get(name)`: the strategy trained inside its own mesh (Explicit axes), once for both tests."""
    made = {}

    def get(name: str):
        if name not in made:
            mesh = strategy_mesh(name, "explicit")
            made[name] = train(name, mesh, mesh)
        return made[name]

    return get


# DDP inside its own Explicit mesh is slow: the fast run trains DDP inside its own Auto mesh (ddp-auto-same), and
# ZeRO-1, the same class, inside its own Explicit mesh (zero1-explicit-same); so is the engine's plain DP: the
# fast run trains the same class (`Parallel`) inside its own Explicit mesh as tp-explicit-same
SLOW = {("ddp", "explicit", "same"), ("engine-dp", "explicit", "same")}


@pytest.mark.parametrize(
    ("name", "axis_types", "context"),
    [pytest.param(*c, id="-".join(c), marks=pytest.mark.slow if c in SLOW else ()) for c in CASES],
)
def test_trains_inside_a_mesh_context(name, axis_types, context, references, inside_own_mesh):
    if (axis_types, context) == ("explicit", "same"):
        result = inside_own_mesh(name)
    else:
        mesh = strategy_mesh(name, axis_types)
        result = train(name, mesh, mesh if context == "same" else other_mesh())
    assert_matches_reference(result, references(STRATEGIES[name][2]))


@pytest.mark.parametrize("name", ["zero1", "tp", "pipeline"])
def test_context_does_not_change_the_run(name, inside_own_mesh):
    """Inside the strategy's own mesh (Explicit axes) and outside any context: the same numbers; the
    canonical state, converted inside the context, holds the same parameters and converts back."""
    mesh = strategy_mesh(name, "explicit")
    outside = train(name, mesh)
    inside = inside_own_mesh(name)
    assert inside[0] == outside[0] and inside[1] == outside[1]
    for a, b in zip(jax.tree.leaves(inside[2]), jax.tree.leaves(outside[2]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    run, state = inside[3], inside[4]
    with jax.set_mesh(mesh):
        canonical = run.canonical(state)
        back = run.from_canonical(canonical)
        params = nnx.to_pure_dict(run.params(back))
        model = run.model(back)
    for a, b in zip(jax.tree.leaves(canonical.params), jax.tree.leaves(inside[2]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(inside[2]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert isinstance(model, GPT)
