"""Validation loss against a hand-computed mean: every validation row counts once, also when the split
has fewer rows than `eval_batches` batches (the last batch is then partial, its padding weighs nothing),
on any batch sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.models.gpt import GPT, GPTConfig
from jaxdist.train.data.prepare import prepare
from jaxdist.train.data.shards import Loader, ShardData
from jaxdist.train.data.sources import CORPUS
from jaxdist.train.evaluate import Evaluator

CFG = GPTConfig(vocab_size=256, seq_len=64, d_model=32, n_heads=4, n_layers=1)


@pytest.fixture(scope="module")
def val_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("data") / "d"
    prepare([CORPUS], directory, val_fraction=0.3, shard_tokens=300, progress=False)  # 24 rows of 65 tokens
    return directory


def expected_loss(model: GPT, directory, n_rows: int) -> float:
    """float64 cross-entropy of predicting each token of the first `n_rows` validation rows, each once."""
    val = np.concatenate([np.fromfile(f, "<u2") for f in sorted(directory.glob("val-*.bin"))]).astype(np.int32)
    tokens = np.stack([val[r * 64 : r * 64 + 65] for r in range(n_rows)])
    logits = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens[:, :-1])), np.float64)
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    return float(-np.take_along_axis(log_probs, tokens[:, 1:, None], -1).mean())


@pytest.mark.parametrize(
    "batch_size, batches, rows",
    [
        (8, 2, 16),  # a split larger than asked: the first rows, in order
        (16, 2, 24),  # 24 rows for 32 asked: the second batch has 8 rows and 8 of padding (whole devices' worth)
        (16, 5, 24),  # 24 rows for 80 asked: the same two batches, nothing read twice
    ],
)
@pytest.mark.parametrize("mesh_shape", [((8,), ("dp",)), ((4, 2), ("dp", "fsdp"))])
def test_validation_loss_is_the_mean_over_each_validation_row_once(val_dir, batch_size, batches, rows, mesh_shape):
    data = ShardData(val_dir, "val", seq_len=64, seed=0, stride=64, shuffle=False)
    assert len(data.windows) == 24
    mesh = jax.make_mesh(*mesh_shape)
    sharding = NamedSharding(mesh, P(mesh.axis_names))
    model = GPT(CFG, nnx.Rngs(5))
    got = Evaluator(Loader(data, batch_size, sharding), batches)(model)
    np.testing.assert_allclose(got, expected_loss(model, val_dir, rows), rtol=1e-6)


@pytest.mark.gpu
def test_validation_loss_with_flash_attention_in_bfloat16_matches_the_float32_mean(val_dir):
    """The per-row loss goes through jax.vmap: cuDNN's attention must batch under it."""
    import dataclasses

    data = ShardData(val_dir, "val", seq_len=64, seed=0, stride=64, shuffle=False)
    gpu = jax.devices("gpu")[:1]
    sharding = NamedSharding(jax.make_mesh((1,), ("dp",), devices=gpu), P("dp"))
    model = GPT(CFG, nnx.Rngs(5))
    fast = GPT(dataclasses.replace(CFG, dtype=jnp.bfloat16, attention="cudnn"), nnx.Rngs(5))
    got = Evaluator(Loader(data, 16, sharding), 2)(fast)
    np.testing.assert_allclose(got, expected_loss(model, val_dir, 24), rtol=2e-2)
