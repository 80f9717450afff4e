"""DDP and ZeRO-1 against a single-device reference, on 8 simulated CPU devices.

Tolerances (float32): the reference takes one mean over the global batch, DDP
the mean of 8 per-device means (and accumulation adds micro-batch sums), so
gradients differ by float32 rounding, ~1e-7 relative. Losses agree to 5e-6
relative. Adam divides each gradient by its own running RMS, so on the few
coordinates whose gradient is itself near rounding level that noise is not
scaled down: one step can move them by a sizeable fraction of lr. Parameters
therefore get two checks: every element within 1e-4 (10% of lr=1e-3; observed
maxima 1.2e-5 for DDP, 3.7e-5 for an embedding row of a rare token under
tensor parallelism), and the mean difference within 5e-7. A real bug (sum instead of
mean, a bucket left out, stale parameters, a skipped update) moves most
coordinates by about lr per step and fails both by orders of magnitude.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.hlo_schedule import entry_schedule, positions
from support.meshes import cpu_mesh
from support.models import MLP, WithUnusedLayers, make_case, mlp_loss
from support.reference import LOSS_RTOL, assert_params_close, train_single_device
from support.runs import ddp_run

from jaxdist.ddp.run import DDP

LR = 1e-3
STEPS = 5


@pytest.fixture(scope="module")
def mesh():
    return cpu_mesh((8,), ("dp",))


OPTIMIZERS = {
    "adam": lambda: optax.adam(LR),
    # not scale-invariant like Adam, so a gradient off by a constant factor fails too
    "sgd-momentum": lambda: optax.sgd(0.5, momentum=0.9),
}


@pytest.fixture(scope="module")
def single_device():
    """The single-device run of a model and optimizer, trained once for DDP and ZeRO-1."""

    @functools.cache
    def run(model: str, opt: str):
        return train_single_device(*make_case(model, STEPS), OPTIMIZERS[opt]())

    return run


# the GPT is slow: the MLP takes both optimizers here, and tests/core/test_canonical.py compares the GPT's
# DDP and ZeRO-1 AdamW runs and its ZeRO-1 SGD-with-momentum run (parameters and moments) with one device in
# the fast run
@pytest.mark.parametrize(
    ("zero1", "model", "opt"),
    [
        pytest.param(
            zero1,
            model,
            opt,
            id=f"{'zero1' if zero1 else 'ddp'}-{model}-{opt}",
            marks=pytest.mark.slow if model == "gpt" else (),
        )
        for zero1 in (False, True)
        for model in ("gpt", "mlp")
        for opt in OPTIMIZERS
    ],
)
def test_matches_single_device(mesh, single_device, model, zero1, opt):
    make_model, loss_fn, batches = make_case(model, STEPS)
    ref_losses, ref_params, *_ = single_device(model, opt)
    losses, params, run, _, _ = ddp_run(
        DDP(mesh, zero1=zero1, bucket_size=1000), make_model, loss_fn, batches, OPTIMIZERS[opt]()
    )
    assert len(run.layout) >= 3  # several buckets, so the overlap machinery is exercised
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_params_close(params, ref_params)
    # the parameters moved: a step that silently did nothing would fail above, but make it explicit
    initial = nnx.state(make_model(), nnx.Param)
    pairs = zip(jax.tree.leaves(params), jax.tree.leaves(initial), strict=True)
    moved = [float(jnp.max(jnp.abs(a - b))) for a, b in pairs]
    assert max(moved) > 1e-3


@pytest.mark.parametrize("average_in_collective", [True, False], ids=["mean", "prescale-sum"])
@pytest.mark.parametrize("zero1", [False, True], ids=["ddp", "zero1"])
def test_gradient_sync_gives_exact_average(mesh, zero1, average_in_collective):
    """Every element's gradient on rank r is r+1 (all ones times a per-rank weight); SGD(lr=1) then
    moves every parameter by exactly the average, (1 + ... + 8) / 8 = 4.5."""
    make_model, _, _ = make_case("mlp", 1)

    def loss(model, batch):  # d loss / d p = mean(batch["w"]) for every element
        total = sum(jnp.sum(p) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
        return jnp.mean(batch["w"]) * total

    batch = {"w": np.repeat(np.arange(1, 9, dtype=np.float32), 2)}  # 2 samples per rank, rank r gets r+1
    cfg = DDP(mesh, zero1=zero1, bucket_size=1000, average_in_collective=average_in_collective)
    run = cfg.prepare(make_model(), optax.sgd(1.0), loss, batch)
    before = run.params(run.state)
    before = jax.tree.map(np.asarray, before)
    state, _ = run.step(run.state, batch)
    after = run.params(state)
    for b, a in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b - np.float32(4.5))  # sgd: p + (-1.0 * g), in float32


def test_all_ones_gradient_stays_one(mesh):
    make_model, _, _ = make_case("mlp", 1)

    def loss(model, batch):
        return sum(jnp.sum(p) for p in jax.tree.leaves(nnx.state(model, nnx.Param))) + 0 * jnp.sum(batch["w"])

    for zero1 in (False, True):
        for avg in (True, False):
            run = DDP(mesh, zero1=zero1, average_in_collective=avg).prepare(
                make_model(), optax.sgd(1.0), loss, {"w": np.ones(8, np.float32)}
            )
            before = jax.tree.map(np.asarray, run.params(run.state))
            state, m = run.step(run.state, {"w": np.ones(8, np.float32)})
            for b, a in zip(jax.tree.leaves(before), jax.tree.leaves(run.params(state)), strict=True):
                np.testing.assert_array_equal(np.asarray(a), b - np.float32(1.0))
            n = sum(x.size for x in jax.tree.leaves(before))
            assert float(m["grad_norm"]) == pytest.approx(np.sqrt(n), rel=1e-6)


def test_zero1_shards_the_optimizer_state(mesh):
    make_model, loss_fn, batches = make_case("gpt", 1)
    sizes = {}
    for zero1 in (False, True):
        run = DDP(mesh, zero1=zero1, bucket_size=2000).prepare(make_model(), optax.adam(LR), loss_fn, batches[0])
        leaves = [x for x in jax.tree.leaves(run.state.opt_state) if x.ndim >= 1]
        total = sum(x.nbytes for x in leaves)
        per_device = sum(x.addressable_shards[0].data.nbytes for x in leaves)
        sizes[zero1] = (total, per_device)
        if zero1:
            for x in leaves:  # read from the arrays: each device holds a distinct 1/8 slice
                indices = {tuple((i.start, i.stop) for i in s.index) for s in x.addressable_shards}
                assert len(indices) == 8 and x.addressable_shards[0].data.size * 8 == x.size
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(make_model(), nnx.Param)))
    assert sizes[False][1] == sizes[False][0] == 2 * 4 * n_params  # adam's mu and nu, replicated
    total, per_device = sizes[True]
    assert per_device * 8 == total == 2 * 4 * n_params  # 1/dp per device (every GPT dimension divides by 8)


def test_accumulation_equals_one_big_batch(mesh):
    make_model, loss_fn, batches = make_case("mlp", 3, batch_size=32)
    ref_losses, ref_params, *_ = train_single_device(make_model, loss_fn, batches, optax.adam(LR))
    for zero1 in (False, True):
        cfg = DDP(mesh, zero1=zero1, bucket_size=2000, accumulation_steps=4)
        losses, params, *_ = ddp_run(cfg, make_model, loss_fn, batches, optax.adam(LR))
        np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
        assert_params_close(params, ref_params)


@pytest.mark.parametrize("average_in_collective", [True, False], ids=["mean", "prescale-sum"])
@pytest.mark.parametrize("zero1", [False, True], ids=["ddp", "zero1"])
def test_accumulation_averages_the_micro_batch_gradients(mesh, zero1, average_in_collective):
    """Every gradient element is 1 on every micro-batch: the mean is 1, so SGD(lr=1) moves every
    parameter by exactly 1 and grad_norm is sqrt(#params), whatever accumulation_steps is."""
    make_model, _, _ = make_case("mlp", 1)

    def loss(model, batch):
        return sum(jnp.sum(p) for p in jax.tree.leaves(nnx.state(model, nnx.Param))) + 0 * jnp.sum(batch["w"])

    batch = {"w": np.ones(32, np.float32)}
    cfg = DDP(mesh, zero1=zero1, average_in_collective=average_in_collective, accumulation_steps=2)
    run = cfg.prepare(make_model(), optax.sgd(1.0), loss, batch)
    before = jax.tree.map(np.asarray, run.params(run.state))
    state, m = run.step(run.state, batch)
    for b, a in zip(jax.tree.leaves(before), jax.tree.leaves(run.params(state)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b - np.float32(1.0))
    n = sum(x.size for x in jax.tree.leaves(before))
    assert float(m["grad_norm"]) == pytest.approx(np.sqrt(n), rel=1e-6)


@pytest.mark.parametrize(
    "zero1, average_in_collective, max_grad_norm, pack_buckets",
    [
        (False, True, None, True),
        (True, True, None, True),
        (False, False, 0.05, True),
        (True, False, 0.05, True),
        (False, False, 0.05, False),
        (True, True, 0.05, False),
    ],
    ids=["ddp", "zero1", "ddp-prescale-clip", "zero1-prescale-clip", "ddp-unpacked", "zero1-unpacked-clip"],
)
def test_accumulation_with_sgd_matches_one_big_batch(mesh, zero1, average_in_collective, max_grad_norm, pack_buckets):
    """SGD is not scale-invariant: a gradient summed instead of averaged over micro-batches moves the
    parameters accumulation_steps times too far, and the clip and grad_norm see a too-large norm.
    `pack_buckets=False` (one collective per parameter) must compute the same."""
    make_model, loss_fn, batches = make_case("mlp", 3, batch_size=32)
    lr = 0.5
    clip = [] if max_grad_norm is None else [optax.clip_by_global_norm(max_grad_norm)]
    ref_losses, ref_params, ref_norms, _ = train_single_device(
        make_model, loss_fn, batches, optax.chain(*clip, optax.sgd(lr))
    )
    cfg = DDP(
        mesh,
        zero1=zero1,
        bucket_size=2000,
        accumulation_steps=4,
        average_in_collective=average_in_collective,
        max_grad_norm=max_grad_norm,
        pack_buckets=pack_buckets,
    )
    losses, params, _, _, metrics = ddp_run(cfg, make_model, loss_fn, batches, optax.sgd(lr))
    if max_grad_norm is not None:
        assert ref_norms[0] > max_grad_norm  # the clip is active
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    np.testing.assert_allclose([float(m["grad_norm"]) for m in metrics], ref_norms, rtol=1e-5)
    assert_params_close(params, ref_params)


def test_other_strategies_have_no_accumulation_option():
    """Only DDP accumulates; FSDP and the unit engine refuse the option instead of ignoring it."""
    from jaxdist.engine.fsdp import FSDP
    from jaxdist.engine.run import Parallel

    with pytest.raises(TypeError, match="accumulation_steps"):
        FSDP(cpu_mesh((8,), ("fsdp",)), accumulation_steps=2)
    with pytest.raises(TypeError, match="accumulation_steps"):
        Parallel(cpu_mesh((4, 2), ("dp", "tp")), accumulation_steps=2)


@pytest.mark.parametrize("zero1", [False, True], ids=["ddp", "zero1"])
def test_nonfinite_gradient_skips_the_step_and_reports_it(mesh, zero1):
    make_model, loss_fn, batches = make_case("mlp", 4)
    poisoned = [dict(b) for b in batches]
    poisoned[1]["x"] = poisoned[1]["x"].copy()
    poisoned[1]["x"][5, 3] = np.nan  # one sample on one rank
    run = DDP(mesh, zero1=zero1, bucket_size=2000).prepare(make_model(), optax.adam(LR), loss_fn, batches[0])
    state = run.state
    state, m0 = run.step(state, poisoned[0])
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    state, m1 = run.step(state, poisoned[1])
    assert not bool(m0["skipped"]) and bool(m1["skipped"])
    assert not np.isfinite(float(m1["grad_norm"]))
    for b, a in zip(jax.tree.leaves(before), jax.tree.leaves((state.params, state.opt_state)), strict=True):
        np.testing.assert_array_equal(b, np.asarray(a))  # nothing changed, nothing corrupted
    for batch in poisoned[2:]:
        state, m = run.step(state, batch)
        assert not bool(m["skipped"])
    # equal to a run that never saw the poisoned batch
    ref_losses, ref_params, *_ = train_single_device(make_model, loss_fn, [batches[0], *batches[2:]], optax.adam(LR))
    assert_params_close(run.params(state), ref_params)


def _mlp_schedule(mesh, zero1: bool, pack_buckets: bool = True):
    def make_model():
        return MLP(6, 32, nnx.Rngs(0))

    batch = {"x": np.ones((16, 32), np.float32), "y": np.ones((16, 32), np.float32)}
    cfg = DDP(mesh, zero1=zero1, bucket_size=1000, pack_buckets=pack_buckets)
    run = cfg.prepare(make_model(), optax.adam(LR), mlp_loss, batch)
    assert len(run.layout) == 6  # one bucket per layer
    return entry_schedule(run.step.lower(run.state, batch).compile().as_text())


def test_bucket_reductions_overlap_backward_in_the_schedule(mesh):
    sched = _mlp_schedule(mesh, zero1=False)
    matmuls = positions(sched, "matmul")
    reductions = positions(sched, "all-reduce", "1152]")  # bucket-sized all-reduces (1088 used -> 1152)
    assert reductions, sched
    # the first bucket is reduced while backward still has matmuls to run (at least 2 layers' worth)
    assert sum(m > reductions[0] for m in matmuls) >= 4
    # and reductions are spread through backward, not bunched at the end
    assert len({sum(m < r for m in matmuls) for r in reductions}) >= 3


def test_zero1_gathers_overlap_forward_and_scatters_overlap_backward(mesh):
    sched = _mlp_schedule(mesh, zero1=True)
    matmuls = positions(sched, "matmul")
    gathers = positions(sched, "all-gather", "1152]")
    scatters = positions(sched, "reduce-scatter", "144]")
    assert len(gathers) == 6 and len(scatters) == 6
    # the last bucket's gather comes after the first forward matmul, each gather one layer ahead:
    # bucket k's gather is issued before layer k's matmul (its use) and no earlier than after layer
    # k-2's (it waits for the previous bucket's gather and for the compute that reads that bucket)
    assert gathers[-1] > matmuls[0]
    before = [sum(m < g for m in matmuls) for g in gathers]
    assert before[0] == 0 and all(k - 1 <= n <= k for k, n in enumerate(before)), before
    # the first gradient bucket is reduce-scattered before the last backward matmul
    assert scatters[0] < matmuls[-1]
    assert sum(m > scatters[0] for m in matmuls) >= 4


def test_bad_configuration_raises(mesh):
    make_model, loss_fn, batches = make_case("mlp", 1, batch_size=12)
    with pytest.raises(ValueError, match="axis 'data' is not a mesh axis"):
        DDP(mesh, axis="data")
    with pytest.raises(ValueError, match="divisible by dp \\* accumulation_steps = 8"):
        DDP(mesh).prepare(make_model(), optax.adam(LR), loss_fn, batches[0])
    with pytest.raises(ValueError, match="accumulation_steps"):
        DDP(mesh, accumulation_steps=0)


@pytest.mark.parametrize("zero1", [False, True], ids=["ddp", "zero1"])
def test_clipping_and_overlap_off_match_optax_clip(mesh, zero1):
    """max_grad_norm clips by the global norm of the reduced gradient, like optax.clip_by_global_norm
    on one device, also when each rank only holds a shard (zero1); turning overlap off changes nothing."""
    make_model, loss_fn, batches = make_case("mlp", 3)  # the tanh MLP: several buckets, a program of seconds
    ref_losses, ref_params, *_ = train_single_device(
        make_model, loss_fn, batches, optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.5, momentum=0.9))
    )
    cfg = DDP(
        mesh, zero1=zero1, bucket_size=1000, max_grad_norm=0.05, overlap_grad_reduce=False, overlap_param_gather=False
    )
    losses, params, _, _, metrics = ddp_run(cfg, make_model, loss_fn, batches, optax.sgd(0.5, momentum=0.9))
    assert float(metrics[0]["grad_norm"]) > 0.05  # the clip is active
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_params_close(params, ref_params)


def test_zero1_waits_every_gather_it_starts_and_gathers_no_bucket_the_forward_never_reads(mesh, monkeypatch):
    """ZeRO-1 gathers each bucket just ahead of its first use, and waiting one starts the next. A bucket
    the forward never reads needs no gather; one started and never waited (as the end of the step
    left it) is, with the nccl backend, an NCCL write into a buffer XLA may already have reused.
    Lowered for CUDA, so no GPU is needed: every start in the step's HLO has its wait."""
    from jaxdist.comm import nccl

    monkeypatch.setattr(nccl, "_comm_key", lambda axis_name: 7)
    monkeypatch.setattr(nccl, "nccl_backend", nccl.NcclBackend)  # tracing needs no GPU or communicator
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(16, 32)).astype(np.float32), "y": rng.normal(size=(16, 32)).astype(np.float32)}
    run = DDP(mesh, zero1=True, bucket_size=32 * 32 + 32, backend="nccl").prepare(
        WithUnusedLayers(nnx.Rngs(0)), optax.sgd(0.1), mlp_loss, batch
    )
    assert len(run.layout) >= 4  # one bucket per layer: three never read
    hlo = run.step.jitted.trace(run.state, run.step._place(batch)).lower(lowering_platforms=("cuda",)).as_text()
    starts, waits = hlo.count("custom_call @jaxdist_nccl_start"), hlo.count("custom_call @jaxdist_nccl_wait")
    assert sum(bucket.sharded for bucket in run.layout.buckets) >= 3
    assert starts == waits == len(run.layout) + 1  # a reduction per bucket, a gather of the one read


def test_unpacked_zero1_gathers_and_scatters_each_parameter_in_its_buckets_place(mesh):
    """pack_buckets=False: no bucket buffers, one gather and one reduce-scatter per parameter (kernel
    and bias of each layer), still overlapping forward and backward as the buckets do."""
    sched = _mlp_schedule(mesh, zero1=True, pack_buckets=False)
    matmuls = positions(sched, "matmul")
    gathers = positions(sched, "all-gather")
    scatters = positions(sched, "reduce-scatter")
    assert not positions(sched, "all-gather", "1152]")  # no bucket-sized buffer
    assert len(gathers) == 12 and len(scatters) == 12, sched
    assert gathers[-1] > matmuls[0] and scatters[0] < matmuls[-1]
    assert sum(m > scatters[0] for m in matmuls) >= 4


def test_unpacked_ddp_reduces_each_bucket_in_one_variadic_all_reduce(mesh):
    """pack_buckets=False, plain DDP: each bucket's gradients (a layer's kernel and bias) are reduced in
    place by one all-reduce of two operands, not copied into a flat buffer, still spread through backward."""
    sched = _mlp_schedule(mesh, zero1=False, pack_buckets=False)
    matmuls = positions(sched, "matmul")
    reductions = positions(sched, "all-reduce", "(f32[32,32]{1,0}, f32[32]{0}) all-reduce(")
    assert not positions(sched, "all-reduce", "1152]")  # no bucket-sized buffer
    assert len(reductions) == 6, sched  # one per bucket, both of its parameters in one op
    assert sum(m > reductions[0] for m in matmuls) >= 4
    assert len({sum(m < r for m in matmuls) for r in reductions}) >= 3
