"""The work of the cp attention, read back from JAX's own attention inside `shard_map`: every
rank's unmasked (query, key) pairs are the balanced layout's (`jaxdist.cp.attention_pairs`), equal
on every rank under a causal mask and within one chunk's work under a sliding window.

Queries and keys are zero, so each query weighs the keys it may see equally; each value is the
one-hot vector of its token's global index, so a query's output has one nonzero entry per key
it sees."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.meshes import cpu_mesh

from jaxdist import cp
from jaxdist.cp.layout import traced_local_indices


def unmasked_pairs_per_rank(n: int, length: int, window: int | None) -> np.ndarray:
    mesh = cpu_mesh((n,), ("cp",))
    local = 2 * cp.chunk_len(n, length)

    def per_rank(_):
        tokens = traced_local_indices(jax.lax.axis_index("cp"), n, length)
        values = jax.nn.one_hot(tokens, length)[None, :, None, :]  # [1, local, 1 head, length]
        zeros = jnp.zeros((1, local, 1, length))
        with cp.attention_over("cp", n, length):
            window_size = None if window is None else (window, 0)
            out = jax.nn.dot_product_attention(zeros, zeros, values, is_causal=True, local_window_size=window_size)
        return jnp.sum(out > 0).reshape(1)

    body = jax.shard_map(per_rank, mesh=mesh, in_specs=P("cp"), out_specs=P("cp"), check_vma=False)
    return np.asarray(jax.jit(body)(jax.device_put(jnp.zeros((n,)), NamedSharding(mesh, P("cp")))))


@pytest.mark.parametrize(("n", "window"), [(2, None), (4, None), (8, None), (4, 5)])
def test_the_attention_gives_every_rank_the_balanced_work(n, window):
    length = 32
    got = unmasked_pairs_per_rank(n, length, window)
    np.testing.assert_array_equal(got, cp.attention_pairs(n, length, window=window))
    chunk = length // (2 * n)
    if window is None:
        assert len(set(got.tolist())) == 1
    else:
        assert got.max() - got.min() <= chunk * (window + 1)
