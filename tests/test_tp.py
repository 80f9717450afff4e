"""Tensor parallelism (with ZeRO-1 over dp and one-block-ahead gathers) against a single device."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hlo_schedule import entry_schedule, positions
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import cpu_mesh
from test_ddp import LOSS_RTOL, assert_params_close, reference_run

from jaxdist import tp
from jaxdist.tensor_parallel import TensorParallel
from jaxdist.train.gpt import GPT, GPTConfig, next_token_loss

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=8, n_layers=3)
STEPS = 5


def batches(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, 64, (16, 17)).astype(np.int32)} for _ in range(n)]


def run_tp(cfg: TensorParallel, model_cfg, data):
    run = cfg.prepare(GPT(model_cfg, nnx.Rngs(0)), optax.adam(1e-3), data[0])
    state, losses, metrics = run.state, [], []
    for batch in data:
        before = np.asarray(jax.device_put(state.params["blocks"], NamedSharding(cfg.mesh, P())))
        state, m = run.step(state, batch)
        losses.append(float(m["loss"]))
        metrics.append((before, np.asarray(m["weights_used"])))
    return losses, run.params(state), run, metrics


@pytest.fixture(scope="module")
def reference():
    out = {}
    for tie in (False, True):
        cfg = dataclasses.replace(CFG, tie_embeddings=tie)
        make = lambda cfg=cfg: GPT(cfg, nnx.Rngs(0))
        out[tie] = reference_run(make, next_token_loss, batches(STEPS), optax.adam(1e-3))
    return out


@pytest.mark.parametrize(
    ("shape", "options", "tie"),
    [
        ((2, 4), {}, False),
        ((4, 2), {}, True),
        ((4, 2), {"sequence_parallel": True}, False),
        ((1, 8), {}, False),
    ],
    ids=["dp2xtp4", "dp4xtp2-tied", "dp4xtp2-seqpar", "tp8"],
)
def test_matches_single_device(reference, shape, options, tie):
    mesh = cpu_mesh(shape, ("dp", "tp"))
    model_cfg = dataclasses.replace(CFG, tie_embeddings=tie)
    losses, params, *_ = run_tp(TensorParallel(mesh, **options), model_cfg, batches(STEPS))
    ref_losses, ref_params = reference[tie]
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_params_close(params, ref_params)


def test_vocab_parallel_loss_equals_full_logits_loss():
    mesh = cpu_mesh((8,), ("tp",))
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(2, 5, 64)) * 3, jnp.float32)
    labels = jnp.asarray(rng.integers(0, 64, (2, 5)), jnp.int32)

    def full(lg):
        return optax.softmax_cross_entropy_with_integer_labels(lg, labels).mean()

    on_mesh = jax.device_put(labels, NamedSharding(mesh, P()))

    def local(lg, lb):  # loss and gradient of this rank's vocabulary slice, inside shard_map
        return jax.value_and_grad(lambda x: tp.vocab_parallel_cross_entropy(x, lb, "tp").mean())(lg)

    spec = P(None, None, "tp")
    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, P()), out_specs=(P(), spec), check_vma=False))
    loss, grad = f(jax.device_put(logits, NamedSharding(mesh, spec)), on_mesh)
    np.testing.assert_allclose(float(loss), float(full(logits)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(jax.grad(full)(logits)), atol=1e-7)


def test_every_block_computes_with_this_steps_published_weights(reference):
    """Seed 000: a prefetch that read a block's weights before this step's dp gather published
    them would compute with last step's weights. Each block is its own gather unit (its own
    bucket); the sum of the weights each block used must be that of this step's state."""
    mesh = cpu_mesh((2, 4), ("dp", "tp"))
    losses, _, _, metrics = run_tp(TensorParallel(mesh), CFG, batches(STEPS))
    assert len(set(losses)) == STEPS  # the weights change every step
    np.testing.assert_allclose(losses, reference[False][0], rtol=LOSS_RTOL)
    for step, (state_blocks, used) in enumerate(metrics):
        published = state_blocks.reshape(CFG.n_layers, -1).astype(np.float64).sum(axis=1)
        np.testing.assert_allclose(used, published, rtol=1e-5, err_msg=f"step {step}")
        if step:  # and not last step's
            previous = metrics[step - 1][0].reshape(CFG.n_layers, -1).astype(np.float64).sum(axis=1)
            assert np.all(np.abs(used - previous) > 1e-6 * np.abs(previous).max())


def test_remat_issues_no_second_dp_gather_and_gives_the_same_gradients():
    mesh = cpu_mesh((2, 4), ("dp", "tp"))
    data = batches(2)
    out = {}
    for remat in (True, False):
        cfg = TensorParallel(mesh, remat=remat, unroll=True)
        losses, params, run, _ = run_tp(cfg, CFG, data)
        text = run.step.lower(run.state, data[0]).compile().as_text()
        unit = f"f32[{run.block_bucket.size}]"
        out[remat] = (losses, params, sum(1 for line in text.splitlines() if " all-gather(" in line and unit in line))
    assert out[True][2] == out[False][2] == CFG.n_layers  # one dp gather per block, remat or not
    np.testing.assert_allclose(out[True][0], out[False][0], rtol=1e-6)
    assert_params_close(out[True][1], out[False][1], atol=1e-6)


def test_schedule_gathers_the_next_block_before_this_blocks_matmuls():
    mesh = cpu_mesh((2, 4), ("dp", "tp"))
    cfg = dataclasses.replace(CFG, n_layers=4)
    run = TensorParallel(mesh, unroll=True).prepare(GPT(cfg, nnx.Rngs(0)), optax.adam(1e-3), batches(1)[0])
    sched = entry_schedule(run.step.lower(run.state, batches(1)[0]).compile().as_text())
    matmuls = positions(sched, "matmul")
    gathers = positions(sched, "all-gather", f"f32[{run.block_bucket.size}]")
    assert len(gathers) == 4
    before = [sum(m < g for m in matmuls) for g in gathers]
    per_block = before[2] - before[1]
    # blocks 0 and 1 gathered before block 0 computes, then block i+1 between blocks i-1 and i
    assert per_block > 0 and before == [0, 0, per_block, 2 * per_block], before


def test_bad_shapes_raise():
    mesh = cpu_mesh((1, 8), ("dp", "tp"))
    with pytest.raises(ValueError, match="n_heads=4 divisible by 8"):
        TensorParallel(mesh).prepare(GPT(dataclasses.replace(CFG, n_heads=4), nnx.Rngs(0)), optax.adam(1e-3), {})
    with pytest.raises(ValueError, match="axis 'model' is not a mesh axis"):
        TensorParallel(mesh, tp_axis="model")


def test_clipping_uses_the_exact_global_norm():
    """Weights replicated over tp are held by every tp rank; the norm counts them once, so
    clipping matches optax.clip_by_global_norm on one device."""
    mesh = cpu_mesh((2, 4), ("dp", "tp"))
    data = batches(3)
    opt = lambda: optax.sgd(0.5, momentum=0.9)
    ref_losses, ref_params = reference_run(
        lambda: GPT(CFG, nnx.Rngs(0)), next_token_loss, data, optax.chain(optax.clip_by_global_norm(0.05), opt())
    )
    run = TensorParallel(mesh, max_grad_norm=0.05).prepare(GPT(CFG, nnx.Rngs(0)), opt(), data[0])
    state, losses, norms = run.state, [], []
    for batch in data:
        state, m = run.step(state, batch)
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    assert norms[0] > 0.05  # the clip is active
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_params_close(run.params(state), ref_params)


def test_nnx_layers_equal_the_dense_computation():
    """Column-parallel then row-parallel (Megatron's MLP) and a vocab-parallel embedding, as NNX
    modules inside shard_map, against the same math on whole weights."""
    mesh = cpu_mesh((4,), ("tp",))
    rng = np.random.default_rng(2)
    w1, b1 = rng.normal(size=(8, 16)).astype(np.float32), rng.normal(size=(16,)).astype(np.float32)
    w2, b2 = rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(8,)).astype(np.float32)
    table = rng.normal(size=(12, 8)).astype(np.float32)
    tokens = rng.integers(0, 12, (2, 3)).astype(np.int32)
    # each rank's pieces, stacked along a leading axis that shard_map splits
    pieces = [(tp.ColumnParallelLinear.split(w1, b1, r, 4), tp.RowParallelLinear.split(w2, b2, r, 4)) for r in range(4)]
    stack = lambda get: np.stack([get(p) for p in pieces])
    w1s, b1s, w2s = stack(lambda p: p[0][0]), stack(lambda p: p[0][1]), stack(lambda p: p[1][0])
    tables = np.stack([tp.VocabParallelEmbed.split(table, r, 4) for r in range(4)])

    def body(w1, b1, w2, t, tok):
        col = tp.ColumnParallelLinear(w1[0], b1[0], "tp")
        row = tp.RowParallelLinear(w2[0], jnp.asarray(b2), "tp")
        x = tp.VocabParallelEmbed(t[0], "tp")(tok)
        return row(jnp.tanh(col(x)))

    split = P("tp")
    f = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(split, split, split, split, P()), out_specs=P(), check_vma=False)
    )
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    out = f(put(w1s, split), put(b1s, split), put(w2s, split), put(tables, split), put(tokens, P()))
    expected = np.tanh(table[tokens] @ w1 + b1) @ w2 + b2
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)
