"""The unit engine on a transformer written the way published Flax NNX models are.

`support/transformer.py`'s `Transformer` has what the GPT of jaxdist.train does not: RoPE positions and a
padding mask passed to every block as side inputs, blocks returning `(cache, x)`,
grouped-query attention (4 q heads, 2 k/v heads), interleaved sliding-window /
global layers with different RoPE bases (static attributes), layers stacked with
`nnx.vmap` and run with `nnx.scan`, `nnx.with_partitioning` annotations (created
under the mesh with logical axis rules, so the parameters arrive sharded), and a
loss normalized by the number of real tokens, with metrics as aux. Every run is
compared with `support.reference.train_single_device`.
"""

import dataclasses

import numpy as np
import optax
import pytest
from support.meshes import cpu_mesh
from support.reference import LOSS_RTOL, assert_params_close, train_single_device
from support.runs import engine_run
from support.transformer import (
    LENGTHS,
    LIST_UNITS,
    UNITS,
    Config,
    annotated_plan,
    batches,
    make_model,
    model_loss,
    token_losses,
)

from jaxdist.engine.run import Parallel
from jaxdist.tp import plan as tp_plan


def per_example_reference(cfg: Config, batch) -> np.ndarray:
    ce, real = token_losses(make_model(cfg)(batch["tokens"][:, :-1], batch["pos"], batch["mask"]), batch)
    return np.asarray(ce.sum(1) / real.sum(1))


# -- the published-style model under FSDP, TP and FSDP x TP ----------------------------------------

STEPS = 2
MESHES = {
    "fsdp8": ((8,), ("fsdp",), {}),
    "dp4xtp2-remat": ((4, 2), ("dp", "tp"), {"remat": True}),
    # ZeRO-3 keeping activations (remat=False); fsdp8 recomputes (the default)
    "dp2xfsdp2xtp2-seqpar-keep": ((2, 2, 2), ("dp", "fsdp", "tp"), {"sequence_parallel": True, "remat": False}),
}


@pytest.fixture(scope="module")
def stacked_reference():
    return train_single_device(
        lambda: make_model(Config()), model_loss, batches(STEPS), optax.adamw(3e-3, weight_decay=0.1)
    )


# the fast run trains the published-style model over dp x fsdp x tp with sequence parallelism, keeping
# activations; fsdp8 and dp4xtp2 recomputing are slow (recomputing over tp: tests/engine/test_engine.py's
# published-weights and remat tests)
@pytest.mark.parametrize(
    "mesh_name",
    [pytest.param(name, marks=pytest.mark.slow if name != "dp2xfsdp2xtp2-seqpar-keep" else ()) for name in MESHES],
)
def test_published_style_transformer_matches_single_device(stacked_reference, mesh_name):
    """Stacked local/global GQA layers with RoPE positions and a padding mask as side inputs
    (whole under sequence parallelism, closed over by remat), annotated for FSDP x TP and
    created under the mesh, with the TP plan derived from the annotations: losses, gradient
    norms, parameters, per-example losses and the real-token count equal the single device's."""
    shape, names, options = MESHES[mesh_name]
    mesh = cpu_mesh(shape, names)
    cfg = Config()
    plan = annotated_plan(make_model(cfg)) if "tp" in names else None
    strategy = Parallel(mesh, plan=plan, **options)
    data = batches(STEPS)
    losses, params, run, _, metrics = engine_run(
        strategy, lambda: make_model(cfg, mesh), UNITS, data, optax.adamw(3e-3, weight_decay=0.1)
    )
    ref_losses, ref_params, ref_norms, _ = stacked_reference
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    np.testing.assert_allclose([float(m["grad_norm"]) for m in metrics], ref_norms, rtol=1e-5)
    assert_params_close(params, ref_params)
    # the parameters and the optimizer state are the model's stacked tree, the layer axis unsplit
    q = run.state.params["layers"]["local"]["attn"]["q"]["kernel"]
    mu = run.state.opt_state[0].mu["layers"]["local"]["attn"]["q"]["kernel"]
    assert q.shape == mu.shape == (cfg.pairs, cfg.d, cfg.n_heads * cfg.head_dim)
    assert q.sharding.shard_shape(q.shape)[0] == cfg.pairs
    n_data = 8 // (2 if "tp" in names else 1)
    assert_aux_is_the_single_device_one(metrics[0]["aux"], cfg, data[0], n_data=n_data)


# the fast run updates in backward over fsdp in tests/engine/test_fsdp.py (SGD) and stacked layers train over
# HSDP x TP in tests/strategies/test_odd_models.py
@pytest.mark.slow
def test_stacked_layers_update_in_backward_layer_by_layer(stacked_reference):
    """update_in_backward on stacked layers: slice i of every stacked parameter and of its AdamW
    moments is updated as soon as layer i's gradients are reduced, as one device updates them all."""
    mesh = cpu_mesh((8,), ("fsdp",))
    cfg = Config()
    losses, params, *_ = engine_run(
        Parallel(mesh, update_in_backward=True),
        lambda: make_model(cfg, mesh),
        UNITS,
        batches(STEPS),
        optax.adamw(3e-3, weight_decay=0.1),
    )
    ref_losses, ref_params, _, _ = stacked_reference
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_params_close(params, ref_params)


def assert_aux_is_the_single_device_one(aux, cfg: Config, batch, n_data: int) -> None:
    """Per-example losses come back for the global batch, the token count averaged over data ranks."""
    np.testing.assert_allclose(np.asarray(aux["per_example"]), per_example_reference(cfg, batch), rtol=1e-5)
    np.testing.assert_allclose(float(aux["real_tokens"]), sum(LENGTHS) / n_data, rtol=1e-6)


def test_plan_from_annotations_places_layers_by_their_axes():
    plan = annotated_plan(make_model(Config()))
    column, row = tp_plan.column(), tp_plan.row()
    expected = {
        "embedder": tp_plan.vocab(),
        "head": tp_plan.column(gather_output=True),
        **{f"layers/{b}/attn/{p}": column for b in ("local", "glob") for p in ("q", "k", "v")},
        **{f"layers/{b}/attn/o": row for b in ("local", "glob")},
        **{f"layers/{b}/{p}": column for b in ("local", "glob") for p in ("gate", "up")},
        **{f"layers/{b}/down": row for b in ("local", "glob")},
    }
    assert dict(plan.layers) == expected
    # a list of blocks: one rule per block, by the model's own paths
    listed = annotated_plan(make_model(Config(stacked=False))).layers
    assert listed["layers/0/attn/k"] == column and listed["layers/3/down"] == row and len(listed) == 2 + 4 * 7
    # the model dimension onto tp: no placement splits an embedding's features (nor a norm's scale)
    with pytest.raises(ValueError, match="embedder \\(Embed\\) maps embedding axes \\[-1\\]"):
        tp_plan.TPPlan.from_annotations(make_model(Config()), {"embed": "tp"})


# -- blocks that differ in static attributes, and the global token mean ---------------------------


# with the slow tests: the fast run gives the token mean when ranks count differently in
# tests/models/test_decoder_strategies.py (packed units) and runs blocks of different kinds in
# tests/pipeline/test_pipeline_block_kinds.py
@pytest.mark.slow
def test_blocks_differing_in_static_attributes_and_padding_give_the_single_device_token_mean():
    """The same model with its layers as a list of blocks alternating sliding-window / global
    attention and RoPE bases (static attributes: each block runs its own code), annotated and
    created under the mesh, under FSDP over 8 ranks, each holding a different number of real
    tokens: loss, SGD step and aux are the single device's, the loss the mean over real tokens."""
    cfg = Config(stacked=False)
    data = batches(STEPS)
    mesh = cpu_mesh((8,), ("fsdp",))
    ref_losses, ref_params, ref_norms, _ = train_single_device(
        lambda: make_model(cfg), model_loss, data, optax.sgd(0.5)
    )
    losses, params, _, _, metrics = engine_run(
        Parallel(mesh), lambda: make_model(cfg, mesh), LIST_UNITS, data, optax.sgd(0.5)
    )
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    np.testing.assert_allclose([float(m["grad_norm"]) for m in metrics], ref_norms, rtol=1e-5)
    assert_params_close(params, ref_params, atol=1e-5)
    assert_aux_is_the_single_device_one(metrics[0]["aux"], cfg, data[0], n_data=8)
    # the test can fail: the blocks' windows matter, and a mean of per-rank means is another loss
    same_windows = make_model(cfg)
    same_windows.layers[1].attn.window = cfg.window
    assert abs(float(model_loss(same_windows, data[0])) - ref_losses[0]) > 1e-4
    per_rank_means = per_example_reference(cfg, data[0])
    assert abs(per_rank_means.mean() - ref_losses[0]) > 1e-3


# -- clear errors ---------------------------------------------------------------------------------


def test_units_that_do_not_fit_the_model_raise_clear_errors():
    mesh = cpu_mesh((4, 2), ("dp", "tp"))
    batch = batches(1)[0]
    stacked = make_model(Config())
    with pytest.raises(ValueError, match="pass Units\\(stacked=True\\)"):
        Parallel(cpu_mesh((8,), ("fsdp",))).prepare(stacked, optax.sgd(0.1), LIST_UNITS, batch)
    with pytest.raises(ValueError, match="needs one module with stacked layers"):
        Parallel(cpu_mesh((8,), ("fsdp",))).prepare(make_model(Config(stacked=False)), optax.sgd(0.1), UNITS, batch)
    with pytest.raises(ValueError, match="pass Units\\(has_aux=True\\) or Units\\(sum_and_count=True\\)"):
        units = dataclasses.replace(UNITS, has_aux=False, sum_and_count=False)
        Parallel(cpu_mesh((8,), ("fsdp",))).prepare(stacked, optax.sgd(0.1), units, batch)
    with pytest.raises(ValueError, match="n_kv_heads=1 must be an int divisible by tp=2"):
        cfg = Config(n_kv_heads=1)
        model = make_model(cfg)
        Parallel(mesh, plan=annotated_plan(model)).prepare(model, optax.sgd(0.1), UNITS, batch)
    with pytest.raises(ValueError, match="block 0 returned .*pass Units\\(block_call=...\\)"):
        units = dataclasses.replace(UNITS, block_call=lambda blk, x, b: blk(x, b["pos"], b["mask"]))
        run = Parallel(cpu_mesh((8,), ("fsdp",))).prepare(stacked, optax.sgd(0.1), units, batch)
        run.step.lower(run.state, batch)
