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
from support.cp_models import DECODER_UNITS, Decoder, DecoderConfig, packed_batch
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
