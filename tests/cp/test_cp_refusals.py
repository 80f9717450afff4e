"""What context parallelism would compute wrongly is refused at `prepare`, in one line naming the fix:
a model that numbers its tokens itself, attention that bypasses `jax.nn.dot_product_attention`, a
mask over only the local tokens, a batch with nothing of the sequence's length, a sequence that
does not cut into 2 cp chunks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.cp_models import (
    DECODER_UNITS,
    Decoder,
    DecoderConfig,
    _heads,
    packed_batch,
    reference_run,
    rope,
    units_loss,
)
from support.meshes import cpu_mesh

from jaxdist.engine.run import Parallel, Units
from jaxdist.models.gpt import GPT, UNITS, GPTConfig

CFG = DecoderConfig(n_layers=1)


def prepare(units, batch, model=None, **options):
    model = model or Decoder(CFG, nnx.Rngs(0))
    return Parallel(cpu_mesh((2,), ("cp",)), **options).prepare(model, optax.sgd(0.1), units, batch)


def test_a_model_numbering_its_tokens_with_arange_is_refused():
    def own_positions(block, x, batch):
        return block(x, jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2]), batch["segment_ids"])

    batch = packed_batch(2, 8, 64, seed=0)
    del batch["positions"]
    with pytest.raises(ValueError, match=r"never reads batch\['positions'\].*read positions from batch"):
        prepare(dataclasses.replace(DECODER_UNITS, block_call=own_positions), batch)


class HandWrittenAttention(nnx.Module):
    def __init__(self, rngs):
        self.embedding = nnx.Embed(64, 16, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(16, 16, rngs=rngs)])

    @staticmethod
    def attend(block, x, batch):
        q = block(x) + 0 * batch["positions"][..., None]
        scores = jnp.einsum("btd,bsd->bts", q, x)
        return jnp.einsum("bts,bsd->btd", jax.nn.softmax(scores), x)


def test_attention_that_bypasses_jax_nn_dot_product_attention_is_refused():
    units = Units(
        embed=lambda m, b: m.embedding(b["tokens"]),
        head_loss=lambda m, x, b: jnp.mean(x),
        block_call=HandWrittenAttention.attend,
    )
    batch = {"tokens": np.zeros((2, 8), np.int32)}
    with pytest.raises(ValueError, match=r"never calls jax.nn.dot_product_attention"):
        prepare(units, batch, model=HandWrittenAttention(nnx.Rngs(0)))


def test_a_mask_over_only_the_local_tokens_is_refused():
    with pytest.raises(ValueError, match=r"does not span the whole sequence of 8 tokens.*cp_whole"):
        prepare(DECODER_UNITS, packed_batch(2, 8, 64, seed=0), cp_whole=())  # the document ids cut too


def test_a_gpt_batch_of_t_plus_one_tokens_is_refused_naming_next_token_batch():
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=1), nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"sequence length 8, but none of .*next_token_batch"):
        prepare(UNITS, {"tokens": np.zeros((2, 9), np.int32)}, model=model)


def test_a_sequence_that_does_not_cut_into_2cp_chunks_is_refused_at_prepare():
    with pytest.raises(ValueError, match=r"2 x cp = 4 equal chunks, but the sequence has 6 tokens"):
        prepare(DECODER_UNITS, packed_batch(2, 6, 64, seed=0))


def test_cp_whole_given_as_one_string_is_refused():
    with pytest.raises(ValueError, match=r"cp_whole must be a tuple of batch keys"):
        prepare(DECODER_UNITS, packed_batch(2, 8, 64, seed=0), cp_whole="segment_ids")


def test_a_step_batch_of_another_sequence_length_than_prepares_is_refused():
    """The cut was decided for prepare's length: a shorter batch passed uncut (its attention saw tokens twice:
    silently wrong at half the length) or failed on shapes elsewhere."""
    run = prepare(DECODER_UNITS, packed_batch(2, 8, 64, seed=0))
    run.step(run.state, packed_batch(2, 8, 64, seed=1))  # prepare's length: fine
    for length in (4, 6):
        with pytest.raises(ValueError, match=rf"fixed at prepare \(8 tokens.*has dimension 1 of {length} where"):
            run.step(run.state, packed_batch(2, length, 64, seed=1))


def test_a_mask_of_fewer_dimensions_broadcasts_as_jax_reads_it():
    """A [T, T] document mask (rows sharing one packing) trains as on one device; it was refused as not
    spanning the sequence."""

    def shared_layout(block, x, batch):
        seg = batch["segment_ids"][0]  # [T]
        h = block.norm1(x)
        q = rope(_heads(block.q(h), block.n_heads), batch["positions"])
        k = rope(_heads(block.k(h), block.n_kv_heads), batch["positions"])
        v = _heads(block.v(h), block.n_kv_heads)
        att = jax.nn.dot_product_attention(q, k, v, mask=seg[:, None] == seg[None, :], is_causal=True)
        x = x + block.o(att.reshape(*att.shape[:-2], -1))
        h = block.norm2(x)
        return x + block.down(jax.nn.silu(block.gate(h)) * block.up(h))

    one = packed_batch(2, 8, 64, seed=0)
    batch = {k: np.broadcast_to(v[:1], v.shape).copy() for k, v in one.items()}  # one packing for every row
    units = dataclasses.replace(DECODER_UNITS, block_call=shared_layout)
    losses, norms, _ = reference_run(Decoder(CFG, nnx.Rngs(0)), optax.sgd(0.1), units_loss(units), [batch])
    run = prepare(units, batch)
    _, metrics = run.step(run.state, batch)
    np.testing.assert_allclose([float(metrics["loss"]), float(metrics["grad_norm"])], [losses[0], norms[0]], rtol=1e-5)


def test_per_example_aux_values_are_refused_under_cp_alone():
    """With cp the only data axis the batch spec is P(), so a per-example aux passed as a scalar one: it
    came back averaged over the cp ranks (a per-example loss sum halved at cp=2)."""

    def head_aux(model, x, batch):
        logits = model.embedding.attend(model.norm(x))
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
        return ce.mean(), {"per_example": ce.sum(1)}

    units = dataclasses.replace(DECODER_UNITS, head_loss=head_aux, has_aux=True)
    with pytest.raises(ValueError, match=r"under cp each rank's per-example aux values cover only its tokens"):
        prepare(units, packed_batch(2, 8, 64, seed=0))


def test_a_loss_mixing_the_whole_segment_ids_with_the_cut_labels_is_named():
    def weighted(model, x, batch):  # packed-data losses weight the labels by the documents
        logits = model.embedding.attend(model.norm(x))
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
        return jnp.mean(ce * (batch["segment_ids"] != 0))

    units = dataclasses.replace(DECODER_UNITS, head_loss=weighted)
    with pytest.raises(ValueError, match=r"cuts .*\(labels, tokens\) and keeps cp_whole's whole \(segment_ids\)"):
        prepare(units, packed_batch(2, 8, 64, seed=0))


class WithBatchNorm(nnx.Module):
    """A block with a BatchNorm: under cp each rank would normalize by its own chunks' statistics."""

    def __init__(self, rngs):
        self.embedding = nnx.Embed(64, 16, rngs=rngs)
        self.blocks = nnx.List([nnx.BatchNorm(16, rngs=rngs)])


def test_batch_statistics_are_refused_under_cp():
    def attend(block, x, batch):
        y = block(x)
        q = y.reshape(*y.shape[:2], 1, 16)
        return (
            jax.nn.dot_product_attention(q, q, q, is_causal=True).reshape(y.shape) + 0 * batch["positions"][..., None]
        )

    units = Units(embed=lambda m, b: m.embedding(b["tokens"]), head_loss=lambda m, x, b: jnp.mean(x), block_call=attend)
    with pytest.raises(ValueError, match=r"block 0 holds batch statistics .*under cp each cp rank .*leave cp out"):
        prepare(units, {"tokens": np.zeros((2, 8), np.int32)}, model=WithBatchNorm(nnx.Rngs(0)))


class WithDropout(nnx.Module):
    def __init__(self, rate: float, rngs):
        self.embedding = nnx.Embed(64, 16, rngs=rngs)
        self.blocks = nnx.List([nnx.Dropout(rate, rngs=rngs)])


def test_a_model_with_dropout_trains_under_cp():
    """Its RNG stream failed cp's model check at prepare (flax's TraceContextError)."""

    def attend(block, x, batch):
        q = block(x).reshape(*x.shape[:2], 1, 16)
        return (
            jax.nn.dot_product_attention(q, q, q, is_causal=True).reshape(x.shape) + 0 * batch["positions"][..., None]
        )

    units = Units(
        embed=lambda m, b: m.embedding(b["tokens"]), head_loss=lambda m, x, b: jnp.mean(x**2), block_call=attend
    )
    batch = {"tokens": np.arange(16, dtype=np.int32).reshape(2, 8)}
    losses = {}
    for rate in (0.0, 0.5):
        run = prepare(units, batch, model=WithDropout(rate, nnx.Rngs(0)))
        _, metrics = run.step(run.state, batch)
        losses[rate] = float(metrics["loss"])
    assert np.isfinite(losses[0.5]) and losses[0.5] != losses[0.0], losses
