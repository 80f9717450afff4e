"""Models that are not the GPT under the strategies: non-parameter variables (per-block constants,
dropout RNG streams, BatchNorm statistics) and blocks that must be identical.

References are independent of the strategies: a plain single-device run, or plain flax run on each
rank's local batch by hand. Float32 tolerances are those of tests/support/reference.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.models import NET_UNITS as UNITS
from support.models import Net, net_loss
from support.models import net_batches as data
from support.reference import LOSS_RTOL, assert_params_close, train_single_device
from support.runs import run_steps

from jaxdist.ddp.run import DDP
from jaxdist.engine.fsdp import FSDP
from jaxdist.engine.run import Parallel
from jaxdist.train.checkpoint import Checkpoints

RANKS = 8


@pytest.fixture(scope="module")
def dp_mesh():
    return cpu_mesh((RANKS,), ("dp",))


@pytest.fixture(scope="module")
def fsdp_mesh():
    return cpu_mesh((RANKS,), ("fsdp",))


# -- blocks with their own constants; blocks that differ ------------------------------------------


def test_fsdp_blocks_run_with_their_own_constants(fsdp_mesh):
    """Same parameter shapes, different fixed gains: each block must run with its own gain."""

    def make():
        return Net([0.5, 2.0, -1.0], nnx.Rngs(0))

    batches = data(3)
    ref_losses, ref_params, *_ = train_single_device(make, net_loss, batches, optax.sgd(0.1))
    run = FSDP(fsdp_mesh).prepare(make(), optax.sgd(0.1), UNITS, batches[0])
    state, losses = run_steps(run, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_params_close(run.params(state), ref_params)
    gains = [float(b.gain[...][0]) for b in run.model(state).blocks]
    assert gains == [0.5, 2.0, -1.0]


def test_fsdp_runs_blocks_that_differ_in_static_attributes(fsdp_mesh):
    """Same parameter shapes, block 1 without tanh: each block runs its own definition, as on one device
    (FSDP is the unit engine, which keeps a graphdef per block)."""

    def make():
        return Net([1.0, 1.0, 1.0], nnx.Rngs(0), acts=[True, False, True])

    batches = data(3)
    ref_losses, ref_params, *_ = train_single_device(make, net_loss, batches, optax.sgd(0.1))
    run = FSDP(fsdp_mesh).prepare(make(), optax.sgd(0.1), UNITS, batches[0])
    state, losses = run_steps(run, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_params_close(run.params(state), ref_params)


# dp8 is slow: dp4xtp2 draws the masks per data rank as well, and under tp
@pytest.mark.parametrize(
    ("shape", "names"),
    [pytest.param((8,), ("dp",), id="dp8", marks=pytest.mark.slow), pytest.param((4, 2), ("dp", "tp"), id="dp4xtp2")],
)
def test_the_unit_engine_draws_the_masks_and_statistics_of_ddp(shape, names):
    """Dropout in the embed and every block, BatchNorm in every block: the unit engine folds the
    same data rank and step into each RNG stream as DDP and averages the running statistics the
    same way, so both train identically (under TP every tp rank of a data rank draws the same mask)."""
    from jaxdist.tp import plan as tp_plan

    def make():
        return Net([0.5, 2.0, -1.0], nnx.Rngs(0), input_dropout=0.2, dropout=0.3, batchnorm=True)

    batches = data(3, batch_size=64)
    ddp = DDP(cpu_mesh((shape[0],), ("dp",)), zero1=False).prepare(make(), optax.sgd(0.1), net_loss, batches[0])
    ddp_state, ddp_losses = run_steps(ddp, batches)
    plan = tp_plan.TPPlan({"out": tp_plan.column(gather_output=True)}) if "tp" in names else None
    engine = Parallel(cpu_mesh(shape, names), plan=plan).prepare(make(), optax.sgd(0.1), UNITS, batches[0])
    state, losses = run_steps(engine, batches)
    assert len(set(losses)) == len(losses)
    np.testing.assert_allclose(losses, ddp_losses, rtol=LOSS_RTOL)
    assert_params_close(engine.params(state), ddp.params(ddp_state), atol=1e-5)
    ours, theirs = engine.model(state), ddp.model(ddp_state)
    for i in range(3):  # the running statistics, averaged over the data ranks
        np.testing.assert_allclose(ours.blocks[i].norm.mean[...], theirs.blocks[i].norm.mean[...], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ours.blocks[i].norm.var[...], theirs.blocks[i].norm.var[...], rtol=1e-5, atol=1e-6)
    ours.eval()
    assert ours.blocks[0].drop.deterministic  # eval mode: dropout off, running statistics used


def test_dropout_streams_and_batch_statistics_move_from_ddp_to_the_engine_through_a_checkpoint(tmp_path):
    """The canonical model state is one pure dict for every layout: a DDP run saved after one step
    and restored onto the engine (which draws DDP's masks) continues as the uninterrupted DDP run."""

    def make():
        return Net([0.5, 2.0, -1.0], nnx.Rngs(0), input_dropout=0.2, dropout=0.3, batchnorm=True)

    batches = data(3, batch_size=64)
    mesh = cpu_mesh((8,), ("dp",))
    ddp = DDP(mesh, zero1=False).prepare(make(), optax.sgd(0.1), net_loss, batches[0])
    state, first = run_steps(ddp, batches[:1])
    ckpt = Checkpoints(tmp_path, 1)
    ckpt.save(1, ddp.canonical(state), {})
    ddp_state, more = run_steps(ddp, batches[1:], state)
    engine = Parallel(mesh).prepare(make(), optax.sgd(0.1), UNITS, batches[0])
    ckpt.wait()
    restored = engine.from_canonical(ckpt.restore(1, engine.canonical_target()))
    ckpt.close()
    restored, resumed = run_steps(engine, batches[1:], restored)
    np.testing.assert_allclose(resumed, more, rtol=LOSS_RTOL)
    ours, theirs = engine.model(restored), ddp.model(ddp_state)
    for i in range(3):
        np.testing.assert_allclose(ours.blocks[i].norm.mean[...], theirs.blocks[i].norm.mean[...], rtol=1e-5, atol=1e-6)


# -- dropout: per rank, per step, and resumed -----------------------------------------------------


class MaskProbe(nnx.Module):
    """`loss = sum(dropout(w)) * mean(c)`: with c one-hot on rank r and SGD(1), every w moves by
    -2 * mask_r / 8 (dropout scales kept values by 1 / (1 - 0.5)), so the update shows rank r's mask."""

    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(jnp.ones(256))
        self.drop = nnx.Dropout(0.5, rngs=rngs)


def probe_loss(model, batch):
    return jnp.sum(model.drop(model.w[...])) * jnp.mean(batch["c"])


def on_rank(rank: int):
    return {"c": np.eye(RANKS, dtype=np.float32)[rank]}  # one sample per rank


def mask_step(run, state, rank: int):
    """One step with only `rank` contributing; returns (the mask it drew, the new state)."""
    before = np.asarray(jax.tree.leaves(run.params(state))[0])
    state, _ = run.step(state, on_rank(rank))
    mask = (before - np.asarray(jax.tree.leaves(run.params(state))[0])) / 0.25
    np.testing.assert_array_equal(mask, mask.round())  # exactly 0 or 1
    return mask, state


def copy(state):
    return jax.tree.map(jnp.copy, state)  # the step donates its input


@pytest.mark.parametrize("zero1", [False, True], ids=["ddp", "zero1"])
def test_dropout_masks_differ_per_rank_and_step_and_resume_exactly(dp_mesh, zero1, tmp_path):
    cfg = DDP(dp_mesh, zero1=zero1)
    run = cfg.prepare(MaskProbe(nnx.Rngs(0, dropout=1)), optax.sgd(1.0), probe_loss, on_rank(0))
    by_rank = [mask_step(run, copy(run.state), r)[0] for r in range(3)]
    for mask in by_rank:
        assert 0.3 < mask.mean() < 0.7
    assert not np.array_equal(by_rank[0], by_rank[1]) and not np.array_equal(by_rank[1], by_rank[2])

    state, uninterrupted = run.state, []
    for _ in range(3):
        mask, state = mask_step(run, state, 0)
        uninterrupted.append(mask)
    np.testing.assert_array_equal(uninterrupted[0], by_rank[0])
    assert not np.array_equal(uninterrupted[0], uninterrupted[1])  # the stream advances every step

    # interrupted after one step: the train state through an orbax checkpoint into a fresh run
    def fresh():
        return cfg.prepare(MaskProbe(nnx.Rngs(0, dropout=1)), optax.sgd(1.0), probe_loss, on_rank(0))

    first = fresh()
    _, state = mask_step(first, first.state, 0)
    ckpt = Checkpoints(tmp_path, 1)
    ckpt.save(1, first.canonical(state), {})
    ckpt.wait()
    second = fresh()
    state = second.from_canonical(ckpt.restore(1, second.canonical_target()))
    ckpt.close()
    resumed = []
    for _ in range(2):
        mask, state = mask_step(second, state, 0)
        resumed.append(mask)
    np.testing.assert_array_equal(np.stack(resumed), np.stack(uninterrupted[1:]))


def test_fsdp_dropout_draws_the_masks_of_ddp_and_resumes_exactly(dp_mesh, fsdp_mesh):
    """Dropout in the embed unit and in every block; FSDP and DDP fold the same rank and step into
    the same keys, so they train alike, and an FSDP run resumed from its train state is exact."""

    def make():
        return Net([1.0, 0.5, 2.0], nnx.Rngs(0, dropout=7), input_dropout=0.2, dropout=0.3)

    batches = data(3)
    ddp = DDP(dp_mesh).prepare(make(), optax.sgd(0.1), net_loss, batches[0])
    ddp_state, ddp_losses = run_steps(ddp, batches)
    fsdp = FSDP(fsdp_mesh).prepare(make(), optax.sgd(0.1), UNITS, batches[0])
    state, losses = run_steps(fsdp, batches[:1])
    host = jax.device_get(state)
    state, more = run_steps(fsdp, batches[1:], state)
    np.testing.assert_allclose(losses + more, ddp_losses, rtol=LOSS_RTOL)
    assert_params_close(fsdp.params(state), ddp.params(ddp_state))
    no_dropout = Net([1.0, 0.5, 2.0], nnx.Rngs(0))
    ref_losses, *_ = train_single_device(lambda: no_dropout, net_loss, batches, optax.sgd(0.1))
    assert abs(ddp_losses[0] - ref_losses[0]) > 1e-3  # dropout is on in the step

    restored = jax.tree.map(lambda h, like: jax.device_put(h, like.sharding), host, fsdp.state)
    restored, resumed = run_steps(fsdp, batches[1:], restored)
    assert resumed == more
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- BatchNorm: local statistics per rank, running statistics averaged ----------------------------


def per_rank_reference(make_model, loss_fn, batches, lr: float, accumulation: int = 1):
    """Plain flax on one device: each rank's gradient and BatchNorm statistics from its own local
    batch (train mode; with accumulation, its micro-batches one after another), gradients averaged,
    SGD, running statistics averaged over the ranks."""
    model = make_model()
    model.train()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rest_def = jax.tree.structure(rest)

    def local_loss(p, rest_leaves, local):  # the variables are built inside the trace that mutates them
        m = nnx.merge(graphdef, p, jax.tree.unflatten(rest_def, rest_leaves))
        return loss_fn(m, local), nnx.split(m, nnx.Param, ...)[2]

    grad_fn = jax.jit(jax.value_and_grad(local_loss, has_aux=True))  # one compile, not one per op

    def mean(*xs):
        return sum(xs) / len(xs)

    losses = []
    for batch in batches:
        grads, rests, step_losses = [], [], []
        for r in range(RANKS):
            local = jax.tree.map(lambda x, r=r: np.split(x, RANKS)[r], batch)
            rank_rest = rest
            for j in range(accumulation):
                micro = jax.tree.map(lambda x, j=j: np.split(x, accumulation)[j], local)
                (loss, rank_rest), g = grad_fn(params, jax.tree.leaves(rank_rest), micro)
                grads.append(g)
                step_losses.append(float(loss))
            rests.append(rank_rest)
        params = jax.tree.map(lambda p, *gs: p - lr * mean(*gs), params, *grads)
        rest = jax.tree.map(mean, *rests)
        losses.append(mean(*step_losses))
    return losses, nnx.merge(graphdef, params, rest)


def _bn_stats(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))


# zero1 is slow: ZeRO-1 runs the model in DDP's per-device step, checked in the fast run as ddp (and ddp-accumulate)
@pytest.mark.parametrize(
    "strategy",
    ["ddp", pytest.param("zero1", marks=pytest.mark.slow), "ddp-accumulate", "fsdp", "hsdp-update-in-backward"],
)
def test_batchnorm_uses_local_batches_and_averages_running_stats(dp_mesh, fsdp_mesh, strategy):
    def make():
        return Net([1.0, 0.5], nnx.Rngs(0), batchnorm=True)

    # 16 samples per rank: statistics of only 2 samples (8 ranks, 2 micro-batches of a 32 batch) make
    # BatchNorm's backward amplify float32 rounding past the tolerance
    batches = data(2, batch_size=128)
    accumulation = 2 if strategy == "ddp-accumulate" else 1
    ref_losses, ref_model = per_rank_reference(make, net_loss, batches, 0.1, accumulation)
    if strategy == "fsdp":
        run = FSDP(fsdp_mesh).prepare(make(), optax.sgd(0.1), UNITS, batches[0])
    elif strategy == "hsdp-update-in-backward":  # data ranks over two axes; the model state path of the fused update
        cfg = FSDP(cpu_mesh((2, 4), ("dp", "fsdp")), dp_axis="dp", update_in_backward=True, skip_nonfinite=False)
        run = cfg.prepare(make(), optax.sgd(0.1), UNITS, batches[0])
    else:
        cfg = DDP(dp_mesh, zero1=strategy == "zero1", accumulation_steps=accumulation)
        run = cfg.prepare(make(), optax.sgd(0.1), net_loss, batches[0])
    state, losses = run_steps(run, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_params_close(run.params(state), nnx.state(ref_model, nnx.Param))

    trained = run.model(state)
    stats, ref_stats = _bn_stats(trained), _bn_stats(ref_model)
    for a, b in zip(jax.tree.leaves(stats), jax.tree.leaves(ref_stats), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(jax.tree.leaves(stats)[0]), 0)  # the running means moved

    trained.eval()  # inference with the running statistics
    ref_model.eval()
    x = data(1, seed=1)[0]
    np.testing.assert_allclose(
        np.asarray(net_loss(trained, x)), np.asarray(net_loss(ref_model, x)), rtol=1e-5, atol=1e-6
    )
