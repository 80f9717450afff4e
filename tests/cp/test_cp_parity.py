"""Context parallelism trains as one device does: losses, gradient norms and final parameters of 5
steps (SGD and AdamW) match a plain single-device jax.grad + optax loop, for cp alone and composed
with dp, fsdp, tp (with sequence parallelism on the batch dimension) and pp; on jaxdist's GPT
(causal, learnt positions read from the batch) and on a published-style decoder (rotary positions,
grouped-query attention, packed documents under a document mask, a sliding window)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.cp_models import (
    DECODER_TP_PLAN,
    DECODER_UNITS,
    Decoder,
    DecoderConfig,
    packed_batch,
    reference_run,
    units_loss,
)
from support.meshes import cpu_mesh

from jaxdist.engine.run import Parallel
from jaxdist.models.gpt import GPT, UNITS, GPTConfig, next_token_batch, next_token_loss, tp_plan_for
from jaxdist.pipeline.run import Pipelined

STEPS, ROWS, LENGTH = 5, 4, 16
GPT_CFG = GPTConfig(vocab_size=64, seq_len=LENGTH, d_model=32, n_heads=4, n_layers=2)
DECODER_CFG = DecoderConfig(vocab=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, window=5)
PLAN = tp_plan_for(GPT_CFG)
# AdamW's eps well above float32 noise: a gradient that is zero in exact arithmetic (the key bias, to
# which softmax is blind) is rounding noise, which Adam's normalisation would turn into full-size steps
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adamw": lambda: optax.adamw(1e-2, eps=1e-4, weight_decay=0.1)}


def gpt_batches():
    rng = np.random.default_rng(1)
    tokens = [rng.integers(0, 64, (ROWS, LENGTH + 1)).astype(np.int32) for _ in range(STEPS)]
    return [next_token_batch({"tokens": t}) for t in tokens]


def decoder_batches():
    return [packed_batch(ROWS, LENGTH, 64, seed=s) for s in range(STEPS)]


def gpt_batch_whole(b):  # the reference reads the single-device layout
    return {"tokens": jnp.concatenate([b["tokens"], b["labels"][:, -1:]], axis=1)}


MODELS = {
    # name -> (make model, units, batches, the reference's loss on one batch)
    "gpt": (lambda: GPT(GPT_CFG, nnx.Rngs(0)), UNITS, gpt_batches, lambda m, b: next_token_loss(m, gpt_batch_whole(b))),
    "decoder": (lambda: Decoder(DECODER_CFG, nnx.Rngs(0)), DECODER_UNITS, decoder_batches, units_loss(DECODER_UNITS)),
}

# name -> (model, optimizer, mesh shape, mesh axes, strategy options)
CASES = {
    "gpt-cp2-sgd": ("gpt", "sgd", (2,), ("cp",), {}),
    "decoder-cp2xdp2-adamw": ("decoder", "adamw", (2, 2), ("dp", "cp"), {}),
    "gpt-cp4-adamw": ("gpt", "adamw", (4,), ("cp",), {}),
    "decoder-cp4-sgd": ("decoder", "sgd", (4,), ("cp",), {}),
    "gpt-cp8-sgd": ("gpt", "sgd", (8,), ("cp",), {}),
    "decoder-cp8-adamw": ("decoder", "adamw", (8,), ("cp",), {}),
    "decoder-fsdp2xcp2-sgd": ("decoder", "sgd", (2, 2), ("fsdp", "cp"), {}),
    "decoder-fsdp2xcp2-keep-activations-sgd": ("decoder", "sgd", (2, 2), ("fsdp", "cp"), {"remat": False}),
    "gpt-cp2xtp2-sp-sgd": ("gpt", "sgd", (2, 2), ("cp", "tp"), {"plan": PLAN, "sequence_parallel": True}),
    "gpt-cp2xtp2-sp-sequence-sgd": (
        "gpt",
        "sgd",
        (2, 2),
        ("cp", "tp"),
        {"plan": PLAN, "sequence_parallel": True, "sequence_dim": 1},  # SP cuts the rank's own chunk further
    ),
    "decoder-cp2xtp2-adamw": ("decoder", "adamw", (2, 2), ("cp", "tp"), {"plan": DECODER_TP_PLAN}),
    "gpt-dp2xcp2xtp2-sgd": ("gpt", "sgd", (2, 2, 2), ("dp", "cp", "tp"), {"plan": PLAN}),
    "gpt-pp2xcp2-sgd": ("gpt", "sgd", (2, 2), ("pp", "cp"), {"pipeline": True, "microbatches": 2}),
    "decoder-pp2xcp2-adamw": ("decoder", "adamw", (2, 2), ("pp", "cp"), {"pipeline": True, "microbatches": 2}),
}
FAST = {"gpt-cp2-sgd", "decoder-cp2xdp2-adamw"}


@functools.cache
def reference(model: str, optimizer: str):
    make, _, batches, loss = MODELS[model]
    return reference_run(make(), OPTIMIZERS[optimizer](), loss, batches())


@functools.cache
def run_case(name: str):
    model, optimizer, shape, axes, options = CASES[name]
    make, units, batches, _ = MODELS[model]
    options = dict(options)
    kind = Pipelined if options.pop("pipeline", False) else Parallel
    data = batches()
    run = kind(cpu_mesh(shape, axes), **options).prepare(make(), OPTIMIZERS[optimizer](), units, data[0])
    state, losses, norms = run.state, [], []
    for batch in data:
        state, metrics = run.step(state, batch)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return run, state, losses, norms


def params_close(got, want, atol):
    flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
    flat_want = dict(jax.tree_util.tree_flatten_with_path(want)[0])
    assert len(flat_got) == len(flat_want)
    for path, x in flat_got:
        np.testing.assert_allclose(np.asarray(x), np.asarray(flat_want[path]), atol=atol, err_msg=str(path))


@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in CASES], ids=lambda n: n
)
def test_cp_trains_as_one_device(name):
    model, optimizer, *_ = CASES[name]
    want_losses, want_norms, want_params = reference(model, optimizer)
    run, state, losses, norms = run_case(name)
    np.testing.assert_allclose(losses, want_losses, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(norms, want_norms, rtol=2e-5, atol=2e-5)
    params_close(nnx.to_pure_dict(run.params(state)), want_params, atol=2e-5)


def test_cp_checkpoint_restores_without_cp_and_back():
    """A state taken under cp is canonical: a run without cp (dp on the same devices) restores it, and
    the cp run restores that run's canonical state, with the same parameters and optimizer state."""
    run, state, *_ = run_case("decoder-cp2xdp2-adamw")
    model, optimizer, *_ = CASES["decoder-cp2xdp2-adamw"]
    make, units, batches, _ = MODELS[model]
    plain = Parallel(cpu_mesh((4,), ("dp",))).prepare(make(), OPTIMIZERS[optimizer](), units, batches()[0])
    saved = jax.tree.map(np.asarray, run.canonical(state))
    restored = plain.from_canonical(saved)
    back = run.from_canonical(jax.tree.map(np.asarray, plain.canonical(restored)))
    for tree in (plain.canonical(restored), run.canonical(back)):
        flat, want = jax.tree.leaves(jax.tree.map(np.asarray, tree)), jax.tree.leaves(saved)
        for x, y in zip(flat, want, strict=True):
            np.testing.assert_array_equal(x, y)


def test_cp_model_evaluates_as_the_reference():
    """`run.model(state)` is the plain model: its loss on a whole batch (no cp) is the reference's."""
    run, state, *_ = run_case("decoder-cp2xdp2-adamw")
    _, _, want_params = reference("decoder", "adamw")
    make, _, batches, loss = MODELS["decoder"]
    reference_model = make()
    nnx.update(reference_model, nnx.State(want_params))
    batch = packed_batch(ROWS, LENGTH, 64, seed=99)
    evaluate = nnx.jit(loss)  # one program per model, not one per op on the run's sharded arrays
    np.testing.assert_allclose(
        float(evaluate(run.model(state), batch)), float(evaluate(reference_model, batch)), rtol=1e-5
    )
