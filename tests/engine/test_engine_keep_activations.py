"""ZeRO-3 keeping activations (`Parallel(remat=False)` over an fsdp axis), as PyTorch FSDP does.

The forward keeps its vjp's residuals except those computed from the gathered weights alone
(`jaxdist.engine.residuals`); backward rebuilds those from the weights it gathers again. Checked here:
the training math against a single-device optax run (`support.reference.train_single_device`) and
against DDP with dropout; that backward runs no second forward (its matmuls are plain
autodiff's, counted by hand); that no gathered weights live from forward to backward (temp
memory per layer is activations, not a unit); that backward computes with this step's weights
(no read before publication, docs/design.md); and the dependence analysis itself.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.models import (
    GPT_CFG,
    MLP_PLAN,
    MLP_UNITS,
    ResMLP,
    gpt_batches,
    mlp_batches,
    mlp_loss,
    whole_model_loss,
)
from support.optimizers import adamw, path_optimizer
from support.reference import LOSS_RTOL, assert_params_close, train_single_device
from support.runs import engine_run

from jaxdist.engine import residuals as _residuals
from jaxdist.engine.fsdp import FSDP
from jaxdist.engine.run import Parallel, Units
from jaxdist.models.gpt import GPT, UNITS, next_token_loss, tp_plan_for
from jaxdist.pipeline.run import Pipelined

HSDP_TP = ((2, 2, 2), ("dp", "fsdp", "tp"))
FSDP8 = ((8,), ("fsdp",))


# -- the training math -----------------------------------------------------------------------


def make_gpt():
    return GPT(GPT_CFG, nnx.Rngs(0))


@pytest.fixture(scope="module")
def gpt_sgd_reference():
    """The single-device SGD run both meshes are compared with, trained once."""
    return train_single_device(make_gpt, next_token_loss, gpt_batches(2), optax.sgd(0.5))


# fsdp alone is slow: dp2xfsdp2xtp2 rebuilds the residuals over fsdp as well, and the fast run keeps
# activations over fsdp8 alone in test_dropout_and_batchnorm_train_as_under_ddp
@pytest.mark.parametrize("mesh_name", [pytest.param("fsdp8", marks=pytest.mark.slow), "dp2xfsdp2xtp2"])
def test_gpt_sgd_step_and_grad_norm_match_single_device(gpt_sgd_reference, mesh_name):
    """SGD moves each parameter by lr x its gradient: a residual rebuilt wrong shows at once."""
    shape, names = FSDP8 if mesh_name == "fsdp8" else HSDP_TP
    data = gpt_batches(2)
    make = make_gpt
    ref_losses, ref_params, ref_norms, _ = gpt_sgd_reference
    plan = tp_plan_for(GPT_CFG) if "tp" in names else None
    strategy = Parallel(cpu_mesh(shape, names), plan=plan, remat=False)
    assert strategy.backward_residuals == "rebuild"
    losses, params, _, _, metrics = engine_run(strategy, make, UNITS, data, optax.sgd(0.5))
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    np.testing.assert_allclose([float(m["grad_norm"]) for m in metrics], ref_norms, rtol=1e-5)
    assert_params_close(params, ref_params, atol=1e-5)


# AdamW without update_in_backward is the SGD test's program with another optimizer: left out for suite time
# with the slow tests: update_in_backward trains as one device in the fast run in tests/engine/test_fsdp.py (SGD)
@pytest.mark.slow
@pytest.mark.parametrize("update_in_backward", [True], ids=["update-in-backward"])
def test_gpt_adamw_matches_single_device_through_the_fsdp_wrapper(update_in_backward):
    """HSDP; with update_in_backward each unit is updated as soon as its rebuilt backward reduced it."""
    data = gpt_batches(2)

    def make():
        return GPT(GPT_CFG, nnx.Rngs(0))

    ref_losses, ref_params, _, _ = train_single_device(make, next_token_loss, data, adamw())
    mesh = cpu_mesh((4, 2), ("fsdp", "dp"))
    options = {"update_in_backward": True, "skip_nonfinite": False} if update_in_backward else {}
    strategy = FSDP(mesh, dp_axis="dp", remat=False, **options)
    assert strategy.parallel().backward_residuals == "rebuild"
    losses, params, *_ = engine_run(strategy, make, UNITS, data, adamw())
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_params_close(params, ref_params)


@pytest.mark.parametrize("mesh_name", ["dp2xfsdp2xtp2"])  # fsdp included; the GPT covers fsdp8 alone
def test_any_optax_chain_is_exact_on_a_model_that_is_not_the_gpt(mesh_name):
    """support/models.py's ResMLP (odd widths: some leaves not split over fsdp) with a global-norm
    clip and per-path transforms."""
    shape, names = FSDP8 if mesh_name == "fsdp8" else HSDP_TP
    data = mlp_batches(2)

    def make():
        return ResMLP(nnx.Rngs(0))

    ref_losses, ref_params, ref_norms, _ = train_single_device(make, mlp_loss, data, path_optimizer(0.5))
    strategy = Parallel(cpu_mesh(shape, names), plan=MLP_PLAN, remat=False)
    losses, params, _, _, metrics = engine_run(strategy, make, MLP_UNITS, data, path_optimizer(0.5))
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    np.testing.assert_allclose([float(m["grad_norm"]) for m in metrics], ref_norms, rtol=1e-5)
    assert_params_close(params, ref_params)


# the side-input transformer (stacked, HSDP x TP, sequence parallel) keeping activations:
# tests/engine/test_engine_models.py, mesh dp2xfsdp2xtp2-seqpar-keep


class ScaledBlock(nnx.Module):
    """ReZero / layer scale: a scalar parameter made from a Python float, so JAX types it weakly."""

    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(8, 8, rngs=rngs)
        self.alpha = nnx.Param(jnp.array(0.9))

    def __call__(self, x):
        return x * self.alpha + self.alpha * jnp.tanh(self.lin(x))


class ScaledNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.inp = nnx.Linear(4, 8, rngs=rngs)
        self.blocks = nnx.List([ScaledBlock(rngs) for _ in range(2)])
        self.out = nnx.Linear(8, 3, rngs=rngs)


SCALED_UNITS = Units(embed=lambda m, b: m.inp(b["x"]), head_loss=lambda m, x, b: jnp.mean((m.out(x) - b["y"]) ** 2))


scaled_loss = whole_model_loss(SCALED_UNITS)


@pytest.mark.parametrize("strategy", ["fsdp", "pipeline"])
def test_a_weakly_typed_scalar_weight_trains_as_on_one_device(strategy):
    """The first update makes a weakly typed parameter strong; the second step's program then ordered
    the vjp's residuals otherwise than the first's, whose analysis was reused: an IndexError in backward
    (a permutation of residuals of one shape would have been silently wrong). The state is now strongly
    typed from `prepare` on."""
    rng = np.random.default_rng(0)
    data = [{"x": rng.normal(size=(16, 4)).astype(np.float32), "y": rng.normal(size=(16, 3)).astype(np.float32)}]
    data *= 3
    ref = train_single_device(lambda: ScaledNet(nnx.Rngs(0)), scaled_loss, data, optax.sgd(0.3))
    if strategy == "fsdp":
        run = FSDP(cpu_mesh((4,), ("fsdp",)), remat=False)
    else:
        run = Pipelined(cpu_mesh((2, 2), ("pp", "fsdp")), microbatches=2, remat=False)
    losses, params, _, _, metrics = engine_run(run, lambda: ScaledNet(nnx.Rngs(0)), SCALED_UNITS, data, optax.sgd(0.3))
    np.testing.assert_allclose(losses, ref.losses, rtol=LOSS_RTOL)
    np.testing.assert_allclose([float(m["grad_norm"]) for m in metrics], ref.grad_norms, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref.params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_dropout_and_batchnorm_train_as_under_ddp():
    """Dropout in the embed and every block, BatchNorm in every block: the masks (kept residuals of
    the RNG keys) and statistics of the forward serve backward, so FSDP keeping activations trains
    exactly as DDP, which draws the same masks (tests/strategies/test_strategy_models.py)."""
    from support.models import NET_UNITS, Net, net_loss
    from support.models import net_batches as data
    from support.runs import run_steps

    from jaxdist.ddp.run import DDP

    def make():
        return Net([0.5, 2.0, -1.0], nnx.Rngs(0, dropout=3), input_dropout=0.2, dropout=0.3, batchnorm=True)

    batches = data(2, batch_size=64)
    ddp = DDP(cpu_mesh((8,), ("dp",)), zero1=False).prepare(make(), optax.sgd(0.1), net_loss, batches[0])
    ddp_state, ddp_losses = run_steps(ddp, batches)
    fsdp = FSDP(cpu_mesh((8,), ("fsdp",)), remat=False).prepare(make(), optax.sgd(0.1), NET_UNITS, batches[0])
    state, losses = run_steps(fsdp, batches)
    np.testing.assert_allclose(losses, ddp_losses, rtol=LOSS_RTOL)
    assert_params_close(fsdp.params(state), ddp.params(ddp_state), atol=1e-5)
    ours, theirs = fsdp.model(state), ddp.model(ddp_state)
    for i in range(3):
        np.testing.assert_allclose(ours.blocks[i].norm.mean[...], theirs.blocks[i].norm.mean[...], rtol=1e-5, atol=1e-6)


# -- no second forward, no weights kept ---------------------------------------------------------

D, F, ROWS = 256, 1024, 64  # large weights (2 MiB a block), tiny activations (8 rows per device)
SHALLOW, DEEP = 2, 4


def _compile(strategy: Parallel, layers: int):
    batch = {"x": np.zeros((ROWS, 5), np.float32), "y": np.zeros((ROWS, 6), np.float32)}
    run = strategy.prepare(ResMLP(nnx.Rngs(0), d=D, f=F, layers=layers), optax.sgd(0.1), MLP_UNITS, batch)
    compiled = run.step.lower(run.state, batch).compile()
    dots = sum(1 for line in compiled.as_text().splitlines() if " dot(" in line)
    return compiled.memory_analysis().temp_size_in_bytes, dots


@pytest.fixture(scope="module")
def compiled():
    """(temp bytes, matmuls) of one step per mode and depth: ZeRO-3 keeping activations, ZeRO-3
    recomputing (the default), ZeRO-1 (weights gathered once and kept: plain autodiff)."""
    fsdp, dp = cpu_mesh((8,), ("fsdp",)), cpu_mesh((8,), ("dp",))
    modes = {"keep": Parallel(fsdp, remat=False), "recompute": Parallel(fsdp), "zero1": Parallel(dp)}
    return {(name, n): _compile(s, n) for name, s in modes.items() for n in (SHALLOW, DEEP)}


def test_backward_runs_plain_autodiffs_matmuls_and_no_second_forward(compiled):
    """Per block, forward 2 matmuls, backward 4 (the input and weight gradients of 2 layers); the
    embed 1 + 1, the head 1 + 2. Recomputing adds the block's first forward matmul again (backward
    needs its output; the second's it does not)."""
    for n in (SHALLOW, DEEP):
        plain = 6 * n + 5
        assert compiled["zero1", n][1] == plain, compiled
        assert compiled["keep", n][1] == plain, compiled
        assert compiled["recompute", n][1] == plain + n, compiled


def test_no_gathered_weights_live_from_forward_to_backward(compiled):
    """Each layer more costs ZeRO-3 keeping activations its activations and its gradient shard, not
    a gathered block, as for ZeRO-3 recomputing; weights kept from forward (ZeRO-1, or a residual
    of the weights kept) cost a whole block per layer."""
    unit = (D * F * 2 + D + F) * 4
    growth = {
        name: (compiled[name, DEEP][0] - compiled[name, SHALLOW][0]) / (DEEP - SHALLOW) for name in ("keep", "zero1")
    }
    assert growth["zero1"] >= unit, growth  # the measure sees kept weights
    assert growth["keep"] < unit / 4, (growth, unit)
    keep, recompute, zero1 = (compiled[name, DEEP][0] for name in ("keep", "recompute", "zero1"))
    assert keep < 0.7 * zero1 and keep < 1.1 * recompute, compiled


# -- no read before publication ---------------------------------------------------------------------------------


# no read before publication for both ZeRO-3 modes, forward and backward: tests/engine/test_engine.py
# test_every_block_computes_with_this_steps_published_weights


# -- the dependence analysis ------------------------------------------------------------------------


def _f(w, x, side):
    """Residuals: the weights' cast and transpose (weights alone), a mask of the side input alone, a
    product of x and w, and through a jit (recursed into) and a scan (taken whole)."""
    wb = w["a"].astype(jnp.bfloat16).astype(jnp.float32)
    h = jnp.tanh(x @ w["a"].T) * (side > 0)
    inner = jax.jit(lambda a, v: (jnp.sin(a), jnp.sin(v)))(w["b"], x)
    carried, _ = jax.lax.scan(lambda c, _: (jnp.cos(c), None), w["b"] + 0 * x.sum(), None, length=2)
    return (h @ wb).sum() + (inner[0] * inner[1]).sum() + carried.sum(), None


def test_weight_only_residuals_are_those_reading_the_weights_and_not_x():
    w = {"a": jnp.ones((4, 4)), "b": jnp.ones((3, 4))}
    x, side = jnp.ones((3, 4)), jnp.ones((3, 4))
    leaves = _residuals.residual_leaves(_f, w, x, side)
    flags = _residuals.weight_only(_f, w, x, side)
    assert len(flags) == len(leaves)
    # recomputed from the weights alone (and the side input), the leaves flagged give the forward's
    # values with x replaced by anything: the analysis never calls an x-dependent leaf weight-only
    other = _residuals.residual_leaves(_f, w, x + 1.0, side)
    for leaf, again, flag in zip(leaves, other, flags, strict=True):
        if flag:
            np.testing.assert_array_equal(np.asarray(leaf), np.asarray(again))
    # and some are weight-only: the cast of a, its transpose, cos(b) through the jit
    weight_only = [leaf for leaf, flag in zip(leaves, flags, strict=True) if flag]
    assert len(weight_only) >= 3, [(leaf.shape, flag) for leaf, flag in zip(leaves, flags, strict=True)]
    values = [np.asarray(leaf) for leaf in weight_only]
    assert any(np.allclose(v, np.cos(1.0)) and v.shape == (3, 4) for v in values), values
    # the scan reads x, taken whole: none of its residuals is weight-only
    changed = [i for i, (a, b) in enumerate(zip(leaves, other, strict=True)) if not np.array_equal(a, b)]
    assert changed and not any(flags[i] for i in changed)


def test_rebuilt_residuals_equal_the_forwards_and_run_none_of_its_ops_on_activations():
    """Backward evaluates only the equations of the weight-only residuals: an effectful op on x (the
    nccl backend's collectives are side-effecting FFI calls XLA keeps) does not run again."""
    seen = []

    def fn(w, x, side):
        jax.debug.callback(lambda v: seen.append(v), x)  # effectful, on the activations
        return jnp.tanh(x @ w["a"].astype(jnp.bfloat16).astype(jnp.float32).T) * side, None

    w, x, side = {"a": jnp.full((4, 4), 0.5)}, jnp.ones((3, 4)), jnp.ones((3, 4))
    drop = _residuals.weight_only(fn, w, x, side)
    assert any(drop)
    leaves = _residuals.residual_leaves(fn, w, x, side)
    seen.clear()
    aval = jax.ShapeDtypeStruct(x.shape, x.dtype)
    fresh = jax.jit(lambda w: _residuals.weight_only_values(fn, w, aval, side, drop))(w)
    jax.effects_barrier()
    assert seen == []  # the callback on x did not run
    expected = [leaf for leaf, d in zip(leaves, drop, strict=True) if d]
    for a, b in zip(fresh, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    jaxpr = jax.make_jaxpr(lambda w: _residuals.weight_only_values(fn, w, aval, side, drop))(w)
    assert "debug_callback" not in str(jaxpr) and "tanh" not in str(jaxpr)


def test_remat_options_say_what_backward_keeps():
    from jaxdist.pipeline.run import Pipelined

    mesh = cpu_mesh((8,), ("fsdp",))
    assert Parallel(mesh).backward_residuals == "recompute"
    assert Parallel(mesh, remat=True).backward_residuals == "recompute"
    assert Parallel(mesh, reshard_after_forward=False, remat=False).backward_residuals == "kept"
    assert Parallel(cpu_mesh((8,), ("dp",))).backward_residuals == "kept"
    with pytest.raises(ValueError, match="remat must be None \\(auto\\), True or False"):
        Parallel(mesh, remat="yes")
    pipeline = cpu_mesh((4, 2), ("dp", "pp"))  # a stage keeps its residuals unless told to recompute
    assert Pipelined(pipeline, microbatches=2).keeps_activations
    assert Pipelined(pipeline, remat=False, microbatches=2).keeps_activations
    assert not Pipelined(pipeline, remat=True, microbatches=2).keeps_activations
