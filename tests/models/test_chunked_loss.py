"""`GPTConfig(loss_chunk=C)`: the head's cross-entropy C tokens at a time gives the loss and gradients of
the whole-batch loss (float32 tolerance) and never holds the whole batch's float32 logits."""

import dataclasses
import re

import jax
import numpy as np
import pytest
from flax import nnx

from jaxdist.models.gpt import GPT, GPTConfig, next_token_loss

CFG = GPTConfig(vocab_size=512, seq_len=16, d_model=32, n_heads=4, n_layers=1)
BATCH = {"tokens": np.random.default_rng(0).integers(0, CFG.vocab_size, (4, CFG.seq_len + 1)).astype(np.int32)}


def loss_and_grads(cfg: GPTConfig):
    graphdef, params, rest = nnx.split(GPT(cfg, nnx.Rngs(0)), nnx.Param, ...)

    def loss(params):
        return next_token_loss(nnx.merge(graphdef, params, rest), BATCH)

    return jax.jit(jax.value_and_grad(loss)), params


@pytest.mark.parametrize("chunk", [16, 24, 64], ids=["divides", "padded", "whole-batch"])
def test_chunked_loss_and_gradients_equal_the_whole_batch_loss(chunk):
    """16 and 64 divide the 64 tokens, 24 leaves a padded, masked last chunk."""
    whole, params = loss_and_grads(CFG)
    chunked, _ = loss_and_grads(dataclasses.replace(CFG, loss_chunk=chunk))
    (want, want_grads), (got, got_grads) = whole(params), chunked(params)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got_grads, want_grads)


def _float32_logits_shapes(cfg: GPTConfig) -> set[str]:
    """The shapes of every float32 array with the vocabulary as its last dimension in the compiled step."""
    step, params = loss_and_grads(cfg)
    text = step.lower(params).compile().as_text()
    return set(re.findall(rf"f32\[[\d,]*,{cfg.vocab_size}\]", text))


def test_chunked_loss_never_holds_the_whole_batchs_logits():
    whole = _float32_logits_shapes(CFG)
    assert "f32[4,16,512]" in whole or "f32[64,512]" in whole  # the reading can see them
    chunked = _float32_logits_shapes(dataclasses.replace(CFG, loss_chunk=16))
    tokens = BATCH["tokens"][:, 1:].size
    assert "f32[16,512]" in chunked  # one chunk's logits
    assert all(np.prod([int(d) for d in re.findall(r"\d+", shape)[1:]]) < tokens * CFG.vocab_size for shape in chunked)


def test_bad_loss_chunk_is_refused():
    step, params = loss_and_grads(dataclasses.replace(CFG, loss_chunk=0))
    with pytest.raises(ValueError, match="loss_chunk must be a positive int"):
        step(params)


@pytest.mark.slow  # a strategy run; the fast run checks the chunked loss and its gradients against the whole one above
def test_chunked_loss_trains_as_the_whole_loss_under_the_unit_engine():
    """The head unit under HSDP (dp 2 x fsdp 2): 2 SGD steps, losses and gradient norms as unchunked."""
    import optax
    from support.meshes import cpu_mesh

    from jaxdist.engine.run import Parallel
    from jaxdist.models.gpt import UNITS

    rng = np.random.default_rng(1)
    batches = [{"tokens": rng.integers(0, CFG.vocab_size, (8, CFG.seq_len + 1)).astype(np.int32)} for _ in range(2)]
    runs = []
    for cfg in (CFG, dataclasses.replace(CFG, loss_chunk=24)):
        mesh = cpu_mesh((2, 2), ("dp", "fsdp"))
        run = Parallel(mesh).prepare(GPT(cfg, nnx.Rngs(0)), optax.sgd(0.1), UNITS, batches[0])
        state, seen = run.state, []
        for batch in batches:
            state, metrics = run.step(state, batch)
            seen.append((float(metrics["loss"]), float(metrics["grad_norm"])))
        runs.append(seen)
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-5)
