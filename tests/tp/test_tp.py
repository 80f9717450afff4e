"""Megatron's tensor-parallel layer math (jaxdist.tp) against the same math on whole weights."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.meshes import cpu_mesh

from jaxdist.tp import layers as tp


def test_vocab_parallel_loss_equals_full_logits_loss():
    mesh = cpu_mesh((8,), ("tp",))
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(2, 5, 64)) * 3, jnp.float32)
    labels = jnp.asarray(rng.integers(0, 64, (2, 5)), jnp.int32)

    def full(lg):
        return optax.softmax_cross_entropy_with_integer_labels(lg, labels).mean()

    on_mesh = jax.device_put(labels, NamedSharding(mesh, P()))

    def local(lg, lb):  # loss and gradient of this rank's vocabulary slice, inside shard_map
        return jax.value_and_grad(lambda x: tp.vocab_parallel_cross_entropy(x, lb, "tp").mean())(lg)

    spec = P(None, None, "tp")
    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, P()), out_specs=(P(), spec), check_vma=False))
    loss, grad = f(jax.device_put(logits, NamedSharding(mesh, spec)), on_mesh)
    np.testing.assert_allclose(float(loss), float(full(logits)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(jax.grad(full)(logits)), atol=1e-7)


def test_nnx_layers_equal_the_dense_computation():
    """Column-parallel then row-parallel (Megatron's MLP) and a vocab-parallel embedding, as NNX
    modules inside shard_map, against the same math on whole weights."""
    mesh = cpu_mesh((4,), ("tp",))
    rng = np.random.default_rng(2)
    w1, b1 = rng.normal(size=(8, 16)).astype(np.float32), rng.normal(size=(16,)).astype(np.float32)
    w2, b2 = rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(8,)).astype(np.float32)
    table = rng.normal(size=(12, 8)).astype(np.float32)
    tokens = rng.integers(0, 12, (2, 3)).astype(np.int32)
    # each rank's pieces, stacked along a leading axis that shard_map splits
    pieces = [(tp.ColumnParallelLinear.split(w1, b1, r, 4), tp.RowParallelLinear.split(w2, b2, r, 4)) for r in range(4)]

    def stack(get):
        return np.stack([get(p) for p in pieces])

    w1s, b1s, w2s = stack(lambda p: p[0][0]), stack(lambda p: p[0][1]), stack(lambda p: p[1][0])
    tables = np.stack([tp.VocabParallelEmbed.split(table, r, 4) for r in range(4)])

    def body(w1, b1, w2, t, tok):
        col = tp.ColumnParallelLinear(w1[0], b1[0], "tp")
        row = tp.RowParallelLinear(w2[0], jnp.asarray(b2), "tp")
        x = tp.VocabParallelEmbed(t[0], "tp")(tok)
        return row(jnp.tanh(col(x)))

    split = P("tp")
    f = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(split, split, split, split, P()), out_specs=P(), check_vma=False)
    )

    def put(a, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    out = f(put(w1s, split), put(b1s, split), put(w2s, split), put(tables, split), put(tokens, P()))
    expected = np.tanh(table[tokens] @ w1 + b1) @ w2 + b2
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)
