"""FSDP against a single-device reference and against DDP, on 8 simulated CPU devices.

Tolerances are those of tests/support/reference.py and for the same reason (float32
rounding of a mean of per-device means, seen through Adam).
"""

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support import layouts
from support.hlo_schedule import entry_schedule, positions
from support.meshes import cpu_mesh
from support.reference import LOSS_RTOL, assert_params_close, train_single_device

from jaxdist.ddp.run import DDP
from jaxdist.engine.fsdp import FSDP, Units
from jaxdist.engine.run import Parallel
from jaxdist.models.gpt import GPT, GPTConfig, embed_inputs, head_loss, next_token_loss

UNITS = Units(embed_inputs, head_loss)
CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=5)
STEPS = 5


def batches(n: int, batch_size: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, 64, (batch_size, 17)).astype(np.int32)} for _ in range(n)]


def run_fsdp(cfg: FSDP, model_cfg: GPTConfig, data, optimizer=None):
    run = cfg.prepare(GPT(model_cfg, nnx.Rngs(0)), optimizer or optax.adam(1e-3), UNITS, data[0])
    state, losses = run.state, []
    for batch in data:
        state, m = run.step(state, batch)
        losses.append(float(m["loss"]))
    return losses, run.params(state), run, state


@pytest.fixture(scope="module")
def mesh():
    return cpu_mesh((8,), ("fsdp",))


def single_device(tie: bool):
    """The single-device run of the same 5 steps."""
    cfg = dataclasses.replace(CFG, tie_embeddings=tie)
    return train_single_device(lambda: GPT(cfg, nnx.Rngs(0)), next_token_loss, batches(STEPS), optax.adam(1e-3))


@pytest.fixture(scope="module")
def references():
    """The untied model's single-device run of the same 5 steps, and its DDP run."""
    data = batches(STEPS)
    out = {"single": single_device(tie=False)}
    run = DDP(cpu_mesh((8,), ("dp",)), bucket_size=5000).prepare(
        GPT(CFG, nnx.Rngs(0)), optax.adam(1e-3), next_token_loss, data[0]
    )
    state, losses = run.state, []
    for batch in data:
        state, m = run.step(state, batch)
        losses.append(float(m["loss"]))
    out["ddp"] = (losses, run.params(state))
    return out


@pytest.mark.parametrize(
    ("reshard_after_forward", "buffers"),
    [
        pytest.param(True, 2, id="reshard-2"),
        pytest.param(True, 3, id="reshard-3"),
        # the engine keeping gathered units to backward trains as one device in the fast run too:
        # tests/strategies/test_odd_models.py's fsdp-no-reshard
        pytest.param(False, 2, id="keep-2", marks=pytest.mark.slow),
    ],
)
def test_matches_single_device_and_ddp(mesh, references, buffers, reshard_after_forward):
    cfg = FSDP(mesh, buffers=buffers, prefetch=buffers - 1, reshard_after_forward=reshard_after_forward)
    losses, params, *_ = run_fsdp(cfg, CFG, batches(STEPS))
    for name in ("single", "ddp"):
        ref_losses, ref_params = references[name][:2]
        np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL, err_msg=name)
        assert_params_close(params, ref_params)
    assert len(set(losses)) == STEPS


# a weight tied between the first and the last unit trains as on one device over fsdp8 in the fast run too:
# tests/strategies/test_odd_models.py::test_a_weight_tied_between_embed_and_head_gets_both_gradients[fsdp8]
@pytest.mark.slow
def test_tied_embeddings_match(mesh):
    """The tied embedding is read by the first and the last unit: its two gradients are summed."""
    losses, params, run, _ = run_fsdp(FSDP(mesh), dataclasses.replace(CFG, tie_embeddings=True), batches(STEPS))
    assert run.tied  # the head really re-gathers the embedding unit
    ref_losses, ref_params, *_ = single_device(tie=True)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_params_close(params, ref_params)


# the fast run checks update_in_backward against one device with SGD below (scale-sensitive) and with
# AdamW through this wrapper in tests/engine/test_engine_keep_activations.py
@pytest.mark.slow
def test_update_in_backward_matches_the_ordinary_update(mesh, references):
    data = batches(STEPS)
    losses, params, run, state = run_fsdp(FSDP(mesh, update_in_backward=True, skip_nonfinite=False), CFG, data)
    ordinary_losses, ordinary_params, *_ = run_fsdp(FSDP(mesh), CFG, data)
    np.testing.assert_allclose(losses, ordinary_losses, rtol=1e-6)
    assert_params_close(params, ordinary_params, atol=1e-6)
    ref_losses, ref_params, *_ = references["single"]
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_params_close(params, ref_params)


def test_hsdp_shards_over_fsdp_and_replicates_over_dp():
    # the hsdp2x4 checkpoint layout's model, optimizer and batches (support/layouts.py): FSDP's HSDP compiles
    # that layout's program, and the single-device run is test_canonical's, each compiled once per test run
    mesh = cpu_mesh((2, 4), ("dp", "fsdp"))
    data = layouts.DATA[: layouts.SPLIT]
    run = FSDP(mesh, dp_axis="dp").prepare(layouts.make_model(), layouts.OPTIMIZER, UNITS, data[0])
    state, losses = run.state, []
    for batch in data:
        state, m = run.step(state, batch)
        losses.append(float(m["loss"]))
    ref_losses, ref_params, *_ = train_single_device(layouts.make_model, next_token_loss, data, layouts.OPTIMIZER)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_params_close(run.params(state), ref_params)
    # every parameter in its own shape, split 4 ways over fsdp, the same on both dp rows
    for x in jax.tree.leaves(state.params):
        shards = x.addressable_shards
        assert shards[0].data.size * 4 == x.size, (x.shape, shards[0].data.shape)
        row0 = {str(s.index): np.asarray(s.data) for s in shards if s.device in mesh.devices[0]}
        row1 = {str(s.index): np.asarray(s.data) for s in shards if s.device in mesh.devices[1]}
        assert row0.keys() == row1.keys()
        for index, data in row0.items():
            np.testing.assert_array_equal(data, row1[index])


def test_parameters_and_optimizer_state_are_one_fsdp_th_per_device(mesh):
    run = FSDP(mesh).prepare(GPT(CFG, nnx.Rngs(0)), optax.adam(1e-3), UNITS, batches(1)[0])
    arrays = [x for x in jax.tree.leaves((run.state.params, run.state.opt_state)) if x.size > CFG.n_layers]
    total = sum(x.nbytes for x in arrays)
    per_device = sum(x.addressable_shards[0].data.nbytes for x in arrays)
    assert per_device * 8 == total
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(GPT(CFG, nnx.Rngs(0)), nnx.Param)))
    assert total >= 3 * 4 * n_params  # parameters, mu and nu (plus padding)


MEM_CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=128, n_heads=2, n_layers=4)


def block_size(run) -> int:
    """Elements of one block's parameters (the size of one gathered unit)."""
    return sum(x.size for x in jax.tree.leaves(run.state.params["blocks"][0]))


def _temp_bytes(run, batch) -> int:
    return run.step.lower(run.state, batch).compile().memory_analysis().temp_size_in_bytes


def xla_auto():
    """XLA's automatic FSDP, the baseline that lives with the benchmarks."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import xla_auto

    return xla_auto


SHALLOW, DEEP = 2, 4  # model depths whose temp memory is compared (few: each depth compiles 3 steps)


@pytest.fixture(scope="module")
def memory(mesh):
    """Peak temp memory at depth SHALLOW and DEEP (activations per block: 2x16x128 floats, held fixed)."""
    batch = batches(1)[0]
    out = {}
    for depth in (SHALLOW, DEEP):
        model_cfg = dataclasses.replace(MEM_CFG, n_layers=depth)
        run = FSDP(mesh).prepare(GPT(model_cfg, nnx.Rngs(0)), optax.adam(1e-3), UNITS, batch)
        out["fsdp", depth] = _temp_bytes(run, batch)
        out["unit_bytes"] = block_size(run) * 4
    return out


def fsdp_per_layer(memory) -> float:
    return (memory["fsdp", DEEP] - memory["fsdp", SHALLOW]) / (DEEP - SHALLOW)


def test_temp_memory_grows_only_by_activations_and_gradient_shards(memory):
    unit = memory["unit_bytes"]  # one gathered block
    per_layer = fsdp_per_layer(memory)
    activation = 2 * 16 * 128 * 4  # the block input kept for backward
    grad_shard = unit / 8  # the block's reduce-scattered gradient
    # each extra layer costs its saved input and its gradient shard, not a gathered unit
    assert per_layer <= 1.1 * (activation + grad_shard), (per_layer, activation, grad_shard)
    assert per_layer < unit / 4


# the side-by-side with XLA's automatic FSDP (the benchmarks' baseline) compiles two programs more: slow. The
# fast run bounds FSDP's own growth per layer above (its activations and gradient shards, not a gathered unit)
@pytest.mark.slow
def test_xla_automatic_fsdp_of_the_same_model_keeps_more_per_layer(mesh, memory):
    batch = batches(1)[0]
    auto = {}
    for depth in (SHALLOW, DEEP):
        model = GPT(dataclasses.replace(MEM_CFG, n_layers=depth), nnx.Rngs(0))
        run = xla_auto().AutoShardedRun(
            mesh, model, optax.adam(1e-3), next_token_loss, batch_axes=("fsdp",), shard_axis="fsdp"
        )
        auto[depth] = _temp_bytes(run, batch)
    auto_per_layer = (auto[DEEP] - auto[SHALLOW]) / (DEEP - SHALLOW)
    assert fsdp_per_layer(memory) < auto_per_layer / 10, (memory, auto)
    # FSDP's fixed part is larger (two gathered units are always allocated), so the totals cross over a few
    # layers in: temp memory is linear in depth, and at 8 layers FSDP's total is the smaller one
    deep = 8

    def at_depth(at_deep, per_layer):
        return at_deep + (deep - DEEP) * per_layer

    assert at_depth(memory["fsdp", DEEP], fsdp_per_layer(memory)) < at_depth(auto[DEEP], auto_per_layer), (memory, auto)


# two more compiles: with the slow tests (the fast run bounds FSDP's own growth per layer above)
@pytest.mark.slow
def test_update_in_backward_temp_memory_does_not_grow_with_depth(mesh):
    """Without the sharded gradients of all units at once, only the saved activations grow."""
    batch = batches(1)[0]
    memory = {}
    for depth in (SHALLOW, DEEP):
        model = GPT(dataclasses.replace(MEM_CFG, n_layers=depth), nnx.Rngs(0))
        run = FSDP(mesh, update_in_backward=True, skip_nonfinite=False).prepare(model, optax.adam(1e-3), UNITS, batch)
        memory["update_in_backward", depth] = _temp_bytes(run, batch)
    growth = memory["update_in_backward", DEEP] - memory["update_in_backward", SHALLOW]
    activations = (DEEP - SHALLOW) * 2 * 16 * 128 * 4
    assert growth <= activations + 0.02 * memory["update_in_backward", SHALLOW], memory


def test_schedule_gathers_one_unit_ahead_and_scatters_behind(mesh):
    # the program of test_matches_single_device_and_ddp[reshard-2] (FSDP's defaults): compiled once per test run
    run = FSDP(mesh).prepare(GPT(CFG, nnx.Rngs(0)), optax.adam(1e-3), UNITS, batches(1)[0])
    n = CFG.n_layers
    unit = f"f32[8,{block_size(run) // 8}]"  # every rank's pieces of one block, in one collective
    shard = f"f32[1,{block_size(run) // 8}]"
    sched = entry_schedule(run.step.lower(run.state, batches(1)[0]).compile().as_text())
    matmuls = positions(sched, "matmul")

    def before(i):
        return sum(m < i for m in matmuls)

    gathers = positions(sched, "all-gather", unit)
    scatters = positions(sched, "reduce-scatter", shard)
    assert len(gathers) == 2 * n and len(scatters) == n  # each block gathered in forward and again in backward
    fwd = [before(g) for g in gathers[:n]]
    per_block = fwd[2] - fwd[1]
    assert per_block > 0
    # units 0 and 1 are gathered before unit 0 computes; unit i+1's gather comes after unit i-1's
    # matmuls and before unit i's
    assert fwd == [0, 0, *(k * per_block for k in range(1, n - 1))]
    # backward: unit i's gradients are reduce-scattered after its backward matmuls and before
    # unit i-1's: equal spacing, one unit's matmuls apart
    bwd = [before(s) for s in scatters]
    steps = {b - a for a, b in zip(bwd, bwd[1:], strict=False)}
    assert len(steps) == 1 and steps.pop() > 0
    assert bwd[-1] == len(matmuls)  # the last scatter follows the last block's matmuls
    # and each backward re-gather of the next unit comes before the current unit's matmuls
    bwd_gathers = [before(g) for g in gathers[n:]]
    assert bwd_gathers[0] == bwd_gathers[1] < bwd[0]


def test_deeper_prefetch_needs_a_buffer_more_and_gathers_further_ahead(mesh):
    """No third buffer (docs/design.md, the second failure): the pipelined loop's carry holds `prefetch` in-flight
    units, so prefetch=2 needs buffers=3 (asking for it with 2 raises) and then gathers blocks 0, 1 and 2 before
    block 0 runs."""
    with pytest.raises(ValueError, match="raise buffers to 3"):
        Parallel(mesh, prefetch=2)
    # the program of test_matches_single_device_and_ddp[reshard-3]: compiled once per test run
    run = FSDP(mesh, buffers=3, prefetch=2).prepare(GPT(CFG, nnx.Rngs(0)), optax.adam(1e-3), UNITS, batches(1)[0])
    sched = entry_schedule(run.step.lower(run.state, batches(1)[0]).compile().as_text())
    matmuls = positions(sched, "matmul")
    gathers = positions(sched, "all-gather", f"f32[8,{block_size(run) // 8}]")
    before = [sum(m < g for m in matmuls) for g in gathers[:4]]
    assert before[:3] == [0, 0, 0] and before[3] > 0, before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"buffers": 2, "prefetch": 2}, "prefetch=2 keeps 3 gathered units alive but buffers=2"),
        ({"buffers": 1}, "buffers must be an int >= 2"),
        ({"update_in_backward": True, "max_grad_norm": 1.0}, "cannot clip"),
        ({"update_in_backward": True, "skip_nonfinite": True}, "cannot skip"),
        ({"axis": "tp"}, "axis 'tp' is not a mesh axis"),
    ],
)
def test_bad_options_raise_before_anything_runs(mesh, kwargs, message):
    with pytest.raises(ValueError, match=message):
        FSDP(mesh, **kwargs)


def test_bad_model_or_batch_raise(mesh):
    with pytest.raises(ValueError, match="divisible by the 8 devices"):
        FSDP(mesh).prepare(GPT(CFG, nnx.Rngs(0)), optax.adam(1e-3), UNITS, batches(1, batch_size=12)[0])
    with pytest.raises(ValueError, match="no list of blocks at attribute 'layers'"):
        FSDP(mesh).prepare(GPT(CFG, nnx.Rngs(0)), optax.adam(1e-3), Units(embed_inputs, head_loss, "layers"), {})


# the fast run skips a step over an fsdp axis in tests/strategies/test_skip_nonfinite_on_one_rank.py (a NaN on
# one rank of dp x fsdp x tp: the engine this wrapper builds)
@pytest.mark.slow
def test_skips_a_nonfinite_step(mesh):
    data = batches(3)
    run = FSDP(mesh).prepare(GPT(CFG, nnx.Rngs(0)), optax.adam(1e-3), UNITS, data[0])
    state, _ = run.step(run.state, data[0])
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    nan_loss = Units(embed_inputs, lambda m, x, b: head_loss(m, x, b) * jnp.nan)
    bad = FSDP(mesh).prepare(GPT(CFG, nnx.Rngs(0)), optax.adam(1e-3), nan_loss, data[0])
    state, m = bad.step(state, data[1])
    assert bool(m["skipped"])
    for b, a in zip(jax.tree.leaves(before), jax.tree.leaves((state.params, state.opt_state)), strict=True):
        np.testing.assert_array_equal(b, np.asarray(a))


def bf16_reference(make_model, data, optimizer, ranks: int = 8):
    """One device, compute_dtype=bf16 by hand: each rank's rows through the model with its parameters
    cast to bf16 (a bf16 gradient, widened to float32 by the cast's transpose), the ranks' gradients
    averaged in float32 (reduce_dtype=float32), then optax on float32 parameters."""
    graphdef, params, rest = nnx.split(make_model(), nnx.Param, ...)

    def half(p):
        return jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)

    grad = jax.jit(jax.value_and_grad(lambda p, b: next_token_loss(nnx.merge(graphdef, half(p), rest), b)))
    opt_state, losses = optimizer.init(params), []
    for batch in data:
        parts = [grad(params, jax.tree.map(lambda x, r=r: np.split(x, ranks)[r], batch)) for r in range(ranks)]
        grads = jax.tree.map(lambda *gs: sum(gs) / ranks, *(g for _, g in parts))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(np.mean([float(loss) for loss, _ in parts])))
    return losses, params


def param_diffs(a, b) -> np.ndarray:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return np.concatenate([np.abs(np.asarray(x) - np.asarray(y)).ravel() for x, y in pairs])


# bf16 compute on 8 ranks vs the same on one device: XLA's fusions round a few bf16 intermediates
# differently (seen: losses 1.4e-7 relative, parameters 1e-8 mean, 8e-5 at most, a bf16 rounding step);
# the float32 run is further from it (losses >= 1.6e-6, parameters 6e-6 mean), checked below
BF16_LOSS_RTOL, BF16_PARAM_MEAN_ATOL, BF16_PARAM_ATOL = 5e-7, 1e-7, 2e-4


# with the slow tests: the fast run gathers what a bf16 model computes with through the trainer
# (tests/train/test_train_config.py) and trains bf16 parameters beside float32 ones as one device
# (tests/strategies/test_mixed_parameter_dtypes.py)
@pytest.mark.slow
def test_bf16_compute_matches_a_single_device_bf16_run_and_gathers_bf16(mesh):
    data = batches(3)
    model_cfg = dataclasses.replace(CFG, dtype=None)  # layers compute in their parameters' dtype

    def make():
        return GPT(model_cfg, nnx.Rngs(0))

    def opt():
        return optax.sgd(0.5, momentum=0.9)  # scale-sensitive

    ref_losses, ref_params = bf16_reference(make, data, opt())
    cfg = FSDP(mesh, compute_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
    losses, params, run, state = run_fsdp(cfg, model_cfg, data, opt())
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}  # master parameters
    np.testing.assert_allclose(losses, ref_losses, rtol=BF16_LOSS_RTOL)
    diffs = param_diffs(params, ref_params)
    assert diffs.max() < BF16_PARAM_ATOL and diffs.mean() < BF16_PARAM_MEAN_ATOL, (diffs.max(), diffs.mean())
    # the float32 run differs by more than the tolerance: the parity above sees bf16 compute
    fp32_losses, fp32_params, *_ = train_single_device(make, next_token_loss, data, opt())
    assert all(abs(a - b) > 3 * BF16_LOSS_RTOL * b for a, b in zip(losses, fp32_losses, strict=True))
    assert param_diffs(params, fp32_params).mean() > 10 * BF16_PARAM_MEAN_ATOL
    # what jaxdist asks for: each rank's pieces are cast before the gather, so the collective moves bf16
    # (XLA's CPU backend then widens bf16 collectives to f32 itself)
    text = run.step.lower(state, data[0]).as_text()
    unit = f"x{block_size(run) // 8}x"
    gathers = [line for line in text.splitlines() if "all_gather" in line and unit in line]
    assert len(gathers) == 2 * CFG.n_layers and all(f"{unit}bf16>" in line for line in gathers), gathers[:2]


def test_update_in_backward_matches_single_device_sgd(mesh):
    """Each unit updated inside the step with SGD (scale-sensitive: a gradient off by a factor fails)."""
    data = batches(STEPS)

    def opt():
        return optax.sgd(0.5, momentum=0.9)

    ref_losses, ref_params, *_ = train_single_device(lambda: GPT(CFG, nnx.Rngs(0)), next_token_loss, data, opt())
    losses, params, _, state = run_fsdp(FSDP(mesh, update_in_backward=True), CFG, data, opt())
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_params_close(params, ref_params)
    assert int(state.step) == STEPS


def test_update_in_backward_refuses_an_optimizer_that_combines_parameters(mesh):
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    with pytest.raises(ValueError, match="update_in_backward updates each unit on its own.*clip_by_global_norm"):
        FSDP(mesh, update_in_backward=True).prepare(GPT(CFG, nnx.Rngs(0)), clipped, UNITS, batches(1)[0])
