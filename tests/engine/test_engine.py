"""The unit engine (DP x FSDP x TP through a plan) against a single-device optax run.

Every run is compared with `support.reference.train_single_device`: the unmodified model, one
value_and_grad over the whole global batch, the same optax transformation on
the model's parameter tree (a pure dict), float32. Tolerances as in
tests/support/reference.py (losses rtol 5e-6; parameters atol 1e-4 per element and 5e-7
on average): the engine takes means of per-device means and sums partial
products over tp, which differ from the reference by float32 rounding only.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support import layouts
from support.hlo_schedule import entry_schedule, positions
from support.meshes import cpu_mesh
from support.models import GPT_CFG, MLP_PLAN, MLP_UNITS, ResMLP, gpt_batches, mlp_batches, mlp_loss
from support.optimizers import adamw, path_optimizer
from support.reference import LOSS_RTOL, assert_params_close, train_single_device
from support.runs import engine_run

from jaxdist.engine.run import Parallel
from jaxdist.models.gpt import GPT, UNITS, next_token_loss, tp_plan_for
from jaxdist.tp import plan as tp_plan

STEPS = 5
# -- the GPT on every mesh shape -----------------------------------------------------------

MESHES = {
    "dp2xfsdp2xtp2": ((2, 2, 2), ("dp", "fsdp", "tp")),
    "fsdp2xtp4": ((2, 4), ("fsdp", "tp")),
    "dp4xtp2": ((4, 2), ("dp", "tp")),
}


# AdamW on a schedule, support/layouts.py's: the untied GPT on dp x fsdp x tp is then the program of that
# checkpoint layout (fsdp-tp2x2x2), and its single-device run test_canonical's, each compiled once per test run
GPT_OPTIMIZER = layouts.OPTIMIZER


@pytest.fixture(scope="module")
def gpt_reference():
    out = {}
    for tie in (False, True):
        cfg = dataclasses.replace(GPT_CFG, tie_embeddings=tie)
        out[tie] = train_single_device(
            lambda cfg=cfg: GPT(cfg, nnx.Rngs(0)), next_token_loss, gpt_batches(STEPS), GPT_OPTIMIZER
        )
    return out


# every axis (dp x fsdp x tp) and sequence parallelism (dp4xtp2) in the fast run; the other combinations are slow
SLOW_GPT = {("fsdp2xtp4", False), ("fsdp2xtp4", True), ("dp4xtp2", False), ("dp2xfsdp2xtp2", True)}


@pytest.mark.parametrize(
    ("mesh_name", "seqpar"),
    [
        pytest.param(
            name,
            seqpar,
            id=f"{name}-{'seqpar' if seqpar else ''}",
            marks=pytest.mark.slow if (name, seqpar) in SLOW_GPT else (),
        )
        for name in MESHES
        for seqpar in (False, True)
    ],
)
def test_gpt_matches_single_device(gpt_reference, mesh_name, seqpar):
    shape, names = MESHES[mesh_name]
    tie = mesh_name == "dp4xtp2"  # the tied head (vocab-parallel attend) on one mesh
    cfg = dataclasses.replace(GPT_CFG, tie_embeddings=tie)
    strategy = Parallel(cpu_mesh(shape, names), plan=tp_plan_for(cfg), sequence_parallel=seqpar)
    losses, params, *_ = engine_run(strategy, lambda: GPT(cfg, nnx.Rngs(0)), UNITS, gpt_batches(STEPS), GPT_OPTIMIZER)
    ref_losses, ref_params, _, _ = gpt_reference[tie]
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_params_close(params, ref_params)


# -- a model that is not the GPT, with its own plan and any optax chain ------------------------


@pytest.fixture(scope="module")
def mlp_reference():
    return train_single_device(lambda: ResMLP(nnx.Rngs(0)), mlp_loss, mlp_batches(STEPS), path_optimizer(0.5))


@pytest.mark.parametrize(
    ("shape", "names", "zero1"),
    [
        ((8,), ("dp",), True),
        # FSDP alone is slow: dp2xfsdp2xtp2 shards over an fsdp axis in the fast run
        pytest.param((8,), ("fsdp",), True, marks=pytest.mark.slow),
        # ZeRO-1 x TP trains the MLP in the fast run too: test_update_in_backward_matches_single_device[zero1xtp]
        pytest.param((4, 2), ("dp", "tp"), True, marks=pytest.mark.slow),
        ((2, 2, 2), ("dp", "fsdp", "tp"), True),
        ((4, 2), ("dp", "tp"), False),
    ],
    ids=["zero1", "fsdp", "dp4xtp2", "dp2xfsdp2xtp2", "dp4xtp2-replicated"],
)
def test_any_optax_chain_is_exact_on_a_model_that_is_not_the_gpt(mlp_reference, shape, names, zero1):
    """The optimizer sees the parameter tree: per-path transforms, masks and the global-norm clip
    (active: 0.5 is below the gradient norm) give the single-device result, and grad_norm is the
    single-device norm."""
    strategy = Parallel(cpu_mesh(shape, names), plan=MLP_PLAN, zero1=zero1)
    losses, params, _, _, metrics = engine_run(
        strategy, lambda: ResMLP(nnx.Rngs(0)), MLP_UNITS, mlp_batches(STEPS), path_optimizer(0.5)
    )
    ref_losses, ref_params, ref_norms, _ = mlp_reference
    assert min(ref_norms) > 0.5  # the clip is active every step
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    np.testing.assert_allclose([float(m["grad_norm"]) for m in metrics], ref_norms, rtol=1e-5)
    assert_params_close(params, ref_params)


def test_sgd_step_and_grad_norm_are_exact_with_a_scale_sensitive_optimizer():
    """SGD moves each parameter by lr x its gradient: a wrong gradient scale (a sum over ranks,
    a tp double count) shows at once, unlike with Adam."""
    data = mlp_batches(2)
    _, ref_params, ref_norms, _ = train_single_device(lambda: ResMLP(nnx.Rngs(0)), mlp_loss, data, optax.sgd(0.5))
    strategy = Parallel(cpu_mesh((2, 2, 2), ("dp", "fsdp", "tp")), plan=MLP_PLAN)
    _, params, _, _, metrics = engine_run(strategy, lambda: ResMLP(nnx.Rngs(0)), MLP_UNITS, data, optax.sgd(0.5))
    np.testing.assert_allclose([float(m["grad_norm"]) for m in metrics], ref_norms, rtol=1e-5)
    assert_params_close(params, ref_params, atol=1e-5)


def per_leaf_sgd():
    """SGD with momentum (scale-sensitive) and weight decay masked off for biases: per-leaf, by path."""

    def no_bias(p):
        return jax.tree_util.tree_map_with_path(lambda kp, _: kp[-1].key != "bias", p)

    return optax.chain(optax.masked(optax.add_decayed_weights(0.1), no_bias), optax.sgd(0.1, momentum=0.9))


@pytest.mark.parametrize(
    ("shape", "names"), [((2, 2, 2), ("dp", "fsdp", "tp")), ((4, 2), ("dp", "tp"))], ids=["hsdpxtp", "zero1xtp"]
)
def test_update_in_backward_matches_single_device(shape, names):
    """Each unit is updated inside the step as soon as its gradients are reduced, by the optimizer on
    that unit's parameters and state: exact for a per-leaf optimizer, masks by path included."""
    data = mlp_batches(3)
    ref_losses, ref_params, _, _ = train_single_device(lambda: ResMLP(nnx.Rngs(0)), mlp_loss, data, per_leaf_sgd())
    strategy = Parallel(cpu_mesh(shape, names), plan=MLP_PLAN, update_in_backward=True)
    losses, params, _, state, metrics = engine_run(
        strategy, lambda: ResMLP(nnx.Rngs(0)), MLP_UNITS, data, per_leaf_sgd()
    )
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_params_close(params, ref_params, atol=1e-5)
    assert int(state.step) == 3 and np.isnan(float(metrics[0]["grad_norm"])) and not bool(metrics[0]["skipped"])


def test_update_in_backward_refuses_what_needs_every_gradient_first():
    mesh = cpu_mesh((8,), ("fsdp",))
    with pytest.raises(ValueError, match="cannot clip by it; drop max_grad_norm"):
        Parallel(mesh, update_in_backward=True, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="cannot skip a step"):
        Parallel(mesh, update_in_backward=True, skip_nonfinite=True)
    clip = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    with pytest.raises(ValueError, match="from other parameters' gradients.*clip_by_global_norm"):
        Parallel(mesh, update_in_backward=True).prepare(ResMLP(nnx.Rngs(0)), clip, MLP_UNITS, mlp_batches(1)[0])


@pytest.mark.parametrize(
    "optimizer",
    [
        optax.lamb(1e-3),  # a trust ratio: the norm of the whole parameter and its update
        optax.lars(1e-3),
        optax.chain(optax.clip_by_block_rms(1.0), optax.sgd(0.1)),
        optax.noisy_sgd(0.1, key=0),  # noise drawn for a shard's shape: not the whole's slice
    ],
    ids=["lamb", "lars", "block_rms", "noisy_sgd"],
)
def test_update_in_backward_refuses_an_update_that_reduces_over_a_parameter(optimizer):
    """Updated on each device's shard, these saw a piece of each parameter: 4.3e-3 off one device after 3
    steps (LAMB), silently."""
    mesh = cpu_mesh((8,), ("fsdp",))
    with pytest.raises(ValueError, match=r"not element by element \((reduce_sum|random_bits) of"):
        Parallel(mesh, update_in_backward=True).prepare(ResMLP(nnx.Rngs(0)), optimizer, MLP_UNITS, mlp_batches(1)[0])


def test_update_in_backward_refuses_an_update_decided_by_the_shape_of_stacked_layers():
    """A stacked layer's update runs on one layer: a mask by ndim saw a matrix where one device sees a stack."""
    from support import transformer

    by_ndim = optax.adamw(1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim > 2, p))
    strategy, batch = Parallel(cpu_mesh((8,), ("fsdp",)), update_in_backward=True), transformer.batches(1)[0]
    model = transformer.make_model(transformer.Config())
    with pytest.raises(ValueError, match="other steps for one layer than for the stacked parameter"):
        strategy.prepare(model, by_ndim, transformer.UNITS, batch)
    strategy.prepare(model, adamw(), transformer.UNITS, batch)  # by path: the same steps


def test_compute_dtype_casts_each_piece_before_its_gather():
    """compute_dtype=bf16 under FSDP x TP: every parameter gather moves bf16 (f32 without it), while
    the stored parameters stay float32."""
    mesh = cpu_mesh((4, 2), ("fsdp", "tp"))
    dtypes = {}
    for compute in (None, jnp.bfloat16):
        run = Parallel(mesh, plan=tp_plan_for(GPT_CFG), compute_dtype=compute).prepare(
            GPT(GPT_CFG, nnx.Rngs(0)), adamw(), UNITS, gpt_batches(1)[0]
        )
        assert {x.dtype for x in jax.tree.leaves(run.state.params)} == {jnp.dtype(jnp.float32)}
        text = run.step.lower(run.state, gpt_batches(1)[0]).as_text()
        gathers = [line for line in text.splitlines() if "stablehlo.all_gather" in line and ": (tensor<1x" in line]
        dtypes[compute] = [line.split(": (tensor<1x")[1].split(">")[0].split("x")[-1] for line in gathers]
    assert len(dtypes[None]) == len(dtypes[jnp.bfloat16]) == 2 * GPT_CFG.n_layers + 2  # blocks twice, embed, head
    assert set(dtypes[None]) == {"f32"} and set(dtypes[jnp.bfloat16]) == {"bf16"}, dtypes


def test_state_is_the_models_parameter_tree_sharded_over_the_mesh():
    mesh = cpu_mesh((2, 2, 2), ("dp", "fsdp", "tp"))
    run = Parallel(mesh, plan=MLP_PLAN).prepare(ResMLP(nnx.Rngs(0)), optax.adam(1e-3), MLP_UNITS, mlp_batches(1)[0])
    up = run.state.params["layers"][0]["up"]["kernel"]
    assert up.shape == (16, 24)  # the model's own shape
    # columns over tp (2), then the piece's largest dimension over fsdp (2)
    assert up.sharding.shard_shape(up.shape) == (8, 12)
    mu = run.state.opt_state[0].mu["layers"][0]["up"]["kernel"]
    assert mu.shape == (16, 24) and mu.sharding.shard_shape(mu.shape) == (8, 12)
    bias = run.state.params["out"]["bias"]  # 6 columns: 3 per tp rank, which do not split over fsdp
    assert bias.sharding.shard_shape(bias.shape) == (3,)


# -- structure: published weights, remat, schedule, dtype ----------------------------------------


@pytest.mark.parametrize("remat", [None, False], ids=["recompute", "keep-activations"])
def test_every_block_computes_with_this_steps_published_weights(remat):
    """No read before publication (docs/design.md, the first failure): a block that read its weights before this step's
    gather published them would compute with last step's. Per block, the sum of the weights forward used, and of
    those backward used (ZeRO-3 gathers again: to recompute, or to rebuild the weights' own residuals while keeping
    the activations), equals this step's state, every step."""
    mesh = cpu_mesh((2, 2, 2), ("dp", "fsdp", "tp"))
    cfg = tp_plan_for(GPT_CFG)
    run = Parallel(mesh, plan=cfg, remat=remat, record_weights=True).prepare(
        GPT(GPT_CFG, nnx.Rngs(0)), adamw(), UNITS, gpt_batches(1)[0]
    )
    state, previous = run.state, None
    for batch in gpt_batches(3):
        blocks = nnx.to_pure_dict(run.params(state))["blocks"]
        published = [
            sum(float(np.sum(np.asarray(x, np.float64))) for x in jax.tree.leaves(blocks[i])) for i in range(2)
        ]
        state, m = run.step(state, batch)
        np.testing.assert_allclose(np.asarray(m["weights_used"]), published, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(m["weights_used_backward"]), published, rtol=1e-5)
        if previous is not None:
            assert np.all(np.abs(np.asarray(published) - previous) > 1e-6)
        previous = np.asarray(published)


def _gathers(text: str, size: int) -> int:
    return sum(1 for line in text.splitlines() if " all-gather(" in line and f"[2,{size}]" in line)


def test_remat_issues_no_second_gather():
    # the dp4xtp2 checkpoint layout's model, optimizer and batch (support/layouts.py): without remat, the
    # program the canonical-state and checkpoint tests train (remat=False keeps, as ZeRO-1's default does)
    mesh = cpu_mesh((4, 2), ("dp", "tp"))
    counts = {}
    for remat in (True, False):
        run = Parallel(mesh, plan=layouts.PLAN, remat=remat).prepare(
            layouts.make_model(), layouts.OPTIMIZER, UNITS, layouts.DATA[0]
        )
        text = run.step.lower(run.state, layouts.DATA[0]).compile().as_text()
        counts[remat] = sum(1 for line in text.splitlines() if " all-gather(" in line and "f32[4," in line)
    # embed, 2 blocks, head: one ZeRO-1 gather over dp each, with or without remat
    assert counts[True] == counts[False] == 4, counts


# the same schedule over fsdp is checked in the fast run on FSDP's 5-block parity program, with the backward
# scatters: tests/engine/test_fsdp.py::test_schedule_gathers_one_unit_ahead_and_scatters_behind
@pytest.mark.slow
def test_zero3_gathers_again_for_backward_and_ahead_of_use():
    """Over fsdp each block is gathered for forward and again for backward, one block ahead:
    blocks 0 and 1 are both gathered before block 0's first matmul (the carry holds one
    in-flight unit), block 2 only after block 0 computed."""
    mesh = cpu_mesh((8,), ("fsdp",))
    cfg = dataclasses.replace(GPT_CFG, n_layers=3)
    run = Parallel(mesh).prepare(GPT(cfg, nnx.Rngs(0)), adamw(), UNITS, gpt_batches(1)[0])
    sched = entry_schedule(run.step.lower(run.state, gpt_batches(1)[0]).compile().as_text())
    matmuls = positions(sched, "matmul")
    block = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(GPT(cfg, nnx.Rngs(0)).blocks[0], nnx.Param)))
    gathers = positions(sched, "all-gather", f"f32[8,{block // 8}]")
    assert len(gathers) == 6  # 3 blocks, forward and backward
    before = [sum(m < g for m in matmuls) for g in gathers[:3]]
    assert before[0] == before[1] == 0 and before[2] > 0, before


# a deeper prefetch (buffers=3, prefetch=2): tests/engine/test_fsdp.py, on the program of its reshard-3 parity run


def test_tp_runs_the_models_own_forward_in_its_dtype():
    """A bf16 GPT under TP computes its matmuls in bf16, as on one device (the model's own code runs)."""
    cfg = dataclasses.replace(GPT_CFG, dtype=jnp.bfloat16)
    run = Parallel(cpu_mesh((4, 2), ("dp", "tp")), plan=tp_plan_for(cfg)).prepare(
        GPT(cfg, nnx.Rngs(0)), adamw(), UNITS, gpt_batches(1)[0]
    )
    text = run.step.lower(run.state, gpt_batches(1)[0]).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert dots and all("bf16" in line for line in dots), dots[:3]


# -- errors ----------------------------------------------------------------------------------


def test_vocab_parallel_logits_are_read_only_by_the_vocab_parallel_loss():
    """A head bound with loss_parallel leaves each rank one slice of the logits: a loss that reads
    them otherwise (optax directly, or a z-loss beside the cross-entropy) would be silently wrong,
    so `prepare` (which traces the head) raises instead."""
    mesh = cpu_mesh((4, 2), ("dp", "tp"))

    def labels(batch):
        return batch["tokens"][:, 1:]

    def optax_head_loss(model, x, batch):
        logits = model.logits(x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels(batch)).mean()

    def z_loss_head(model, x, batch):
        logits = model.logits(x)
        return tp_plan.cross_entropy(logits, labels(batch)).mean() + jnp.mean(jax.nn.logsumexp(logits, -1) ** 2)

    for head_loss in (optax_head_loss, z_loss_head):
        units = dataclasses.replace(UNITS, head_loss=head_loss)
        model = GPT(GPT_CFG, nnx.Rngs(0))
        with pytest.raises(ValueError, match="only jaxdist.tp.plan.cross_entropy"):
            Parallel(mesh, plan=tp_plan_for(GPT_CFG)).prepare(model, adamw(), units, gpt_batches(1)[0])


def test_bad_plans_and_meshes_raise_clear_errors():
    mesh = cpu_mesh((4, 2), ("dp", "tp"))
    batch = gpt_batches(1)[0]
    with pytest.raises(ValueError, match="pass plan=TPPlan"):
        Parallel(mesh)
    with pytest.raises(ValueError, match="match no module"):
        bad = tp_plan.TPPlan({**MLP_PLAN.layers, "layers/*/gate": tp_plan.column()})
        Parallel(mesh, plan=bad).prepare(ResMLP(nnx.Rngs(0)), optax.sgd(0.1), MLP_UNITS, mlp_batches(1)[0])
    with pytest.raises(ValueError, match="n_heads=3 must be an int divisible by tp=2"):
        cfg = dataclasses.replace(GPT_CFG, n_heads=3, d_model=48)
        Parallel(mesh, plan=tp_plan_for(cfg)).prepare(GPT(cfg, nnx.Rngs(0)), adamw(), UNITS, batch)
    with pytest.raises(ValueError, match="mesh axes \\['model'\\]"):
        Parallel(cpu_mesh((8,), ("model",)))
    with pytest.raises(ValueError, match="divisible by the 4 devices"):
        Parallel(mesh, plan=tp_plan_for(GPT_CFG)).prepare(
            GPT(GPT_CFG, nnx.Rngs(0)), adamw(), UNITS, {"tokens": np.zeros((6, 17), np.int32)}
        )
