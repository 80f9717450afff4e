"""The Llama-style and Gemma-style decoders against float64 NumPy forwards written from the architecture
description (tests/support/numpy_decoders.py), on random weights (norm gains and biases included, so a
gain read as `scale` instead of `1 + scale`, or a bias dropped, shows): logits of plain and packed
batches, and `decode` with its KV cache, chunk by chunk, against the whole sequence.

Tolerance: the model runs in float32; its logits (of size ~1-10) agree with float64 to ~1e-5, so
2e-4 passes rounding with margin while a wrong mask, rotation or norm moves logits by ~1e-1.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.numpy_decoders import frequencies, gemma_logits, llama_logits

from jaxdist.models import gemma, llama
from jaxdist.models.layers import rope_frequencies

T = 24
ATOL = 2e-4

LLAMA_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
CASES = {
    # name: (model class, config, NumPy forward)
    "llama-gqa-qk-norm": (llama.Llama, dataclasses.replace(llama.FLAVORS["tiny"], seq_len=T), llama_logits),
    "llama-bias-tied-window-llama3-rope": (
        llama.Llama,
        dataclasses.replace(
            llama.FLAVORS["tiny"],
            seq_len=T,
            qk_norm=False,
            qkv_bias=True,
            tie_embeddings=True,
            sliding_window=5,
            rope_scaling=LLAMA_SCALING,  # wavelengths 6 (kept), 20 and 63 (interpolated), 199+ (divided)
            n_kv_heads=1,
        ),
        llama_logits,
    ),
    "gemma-local-global": (
        gemma.Gemma,
        dataclasses.replace(gemma.FLAVORS["tiny"], seq_len=T, n_layers=3, sliding_window=5),
        gemma_logits,
    ),
    "gemma-softcaps": (
        gemma.Gemma,
        dataclasses.replace(gemma.FLAVORS["tiny"], seq_len=T, sliding_window=6, attn_softcap=3.0, final_softcap=4.0),
        gemma_logits,
    ),
}


def random_model(make, cfg, seed: int = 0):
    """The model with every parameter drawn at random: kernels ~ N(0, 1/fan_in), embeddings ~ N(0, 1),
    norm scales and biases ~ N(0.2, 0.3) (Llama's gain `scale`, Gemma's `1 + scale`: both far from 1)."""
    model = make(cfg, nnx.Rngs(0))
    rng = np.random.default_rng(seed)
    params = nnx.state(model, nnx.Param)

    def draw(path, x):
        name = str(path[-1].key)
        if name == "kernel":
            return rng.normal(0, x.shape[0] ** -0.5, x.shape).astype(np.float32)
        if name == "embedding":
            return rng.normal(0, 1, x.shape).astype(np.float32)
        return rng.normal(0.2, 0.3, x.shape).astype(np.float32)

    nnx.replace_by_pure_dict(params, jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(params)))
    nnx.update(model, params)
    return model


def float64_params(model) -> dict:
    return jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def packed(batch: int, t: int, seed: int = 1):
    """Segment ids (documents 1, 2, ...; trailing padding 0) and per-document positions."""
    rng = np.random.default_rng(seed)
    segments = np.zeros((batch, t), np.int32)
    positions = np.zeros((batch, t), np.int32)
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(2, t - 4), 2, replace=False))
        for doc, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, t - 3], strict=True), start=1):
            segments[b, lo:hi] = doc
            positions[b, lo:hi] = np.arange(hi - lo)
    return segments, positions


class Case:
    """One model on random weights, its jitted forward and decode, and the NumPy logits of a batch."""

    def __init__(self, name: str):
        make, self.cfg, reference = CASES[name]
        model = random_model(make, self.cfg)
        graphdef, state = nnx.split(model)
        self.forward = jax.jit(lambda *args: nnx.merge(graphdef, state)(*args))
        self.decode = jax.jit(lambda *args: nnx.merge(graphdef, state).decode(*args))
        self.empty_cache = model.empty_cache
        self.tokens = np.random.default_rng(2).integers(0, self.cfg.vocab_size, (2, T)).astype(np.int32)
        self.segments, self.positions = packed(*self.tokens.shape)
        params = float64_params(model)
        self.want = reference(params, self.cfg, self.tokens)
        self.want_packed = reference(params, self.cfg, self.tokens, self.positions, self.segments)


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return Case(request.param)


def test_logits_match_the_float64_numpy_forward(case):
    got = np.asarray(case.forward(case.tokens))
    assert np.abs(case.want).max() > 1.0  # logits large enough that a wrong layer shows
    np.testing.assert_allclose(got, case.want, rtol=0, atol=ATOL)


def test_packed_documents_are_masked_and_positioned_as_the_numpy_forward(case):
    got = np.asarray(case.forward(case.tokens, case.positions, case.segments))
    np.testing.assert_allclose(got, case.want_packed, rtol=0, atol=ATOL)
    # and a document's logits are those of the document alone (positions restarting at 0)
    alone = case.segments[0] == 2
    np.testing.assert_allclose(got[0, alone], np.asarray(case.forward(case.tokens[:1, alone]))[0], rtol=0, atol=ATOL)


def test_decode_with_the_kv_cache_gives_the_whole_sequences_logits(case):
    """A prefill of 11 tokens, two single tokens, then a chunk of 11: each chunk's logits are the NumPy forward's at
    those positions (the window and the GQA heads read from the cache)."""
    cache = case.empty_cache(case.tokens.shape[0])
    cfg = case.cfg
    assert cache.shape == (cfg.n_layers, 2, 2, cfg.seq_len, cfg.n_kv_heads, cfg.head_dim)
    got, pos = [], 0
    for size in (11, 1, 1, 11):
        logits, cache = case.decode(case.tokens[:, pos : pos + size], cache, jnp.int32(pos))
        got.append(np.asarray(logits))
        pos += size
    assert pos == T
    np.testing.assert_allclose(np.concatenate(got, axis=1), case.want, rtol=0, atol=ATOL)


def test_llama3_frequency_scaling_matches_the_published_rule():
    """The three bands of Llama 3's rule, on the released 8B settings: the highest frequency stays, the
    lowest is divided by 8, one in between is interpolated."""
    cfg = llama.FLAVORS["llama3-8b"]
    got = np.asarray(rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    plain = np.asarray(rope_frequencies(cfg.head_dim, cfg.rope_theta))
    np.testing.assert_allclose(got, frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), rtol=1e-6)
    assert got[0] == plain[0] and got[-1] == pytest.approx(plain[-1] / 8, rel=1e-6)
    between = (got != plain) & ~np.isclose(got, plain / 8, rtol=1e-6)
    assert between.any()
