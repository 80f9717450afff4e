"""Which tokens each cp rank holds, as data: the chunks, their positions, the batch a rank sees,
and the causal load balance (every rank's unmasked attention pairs equal)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist import cp
from jaxdist.cp.layout import split_sequence, traced_local_indices


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_each_rank_holds_chunk_r_and_its_mirror_and_all_ranks_hold_every_token_once(n):
    length = 4 * n
    chunk = length // (2 * n)
    for r in range(n):
        first, second = cp.chunks_of(r, n)
        assert (first, second) == (r, 2 * n - 1 - r)
        want = [*range(first * chunk, (first + 1) * chunk), *range(second * chunk, (second + 1) * chunk)]
        np.testing.assert_array_equal(cp.local_indices(r, n, length), want)
    np.testing.assert_array_equal(np.sort(cp.gathered_indices(n, length)), np.arange(length))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_causal_attention_work_is_equal_on_every_rank_and_the_contiguous_split_is_not(n):
    length = 64
    balanced = cp.attention_pairs(n, length)
    assert balanced.sum() == length * (length + 1) // 2  # every unmasked (query, key) pair, once
    assert len(set(balanced.tolist())) == 1
    contiguous = cp.attention_pairs(n, length, balanced=False)
    assert contiguous.max() / contiguous.min() > 2  # the last rank would wait on the first


@pytest.mark.parametrize(("n", "window"), [(2, 5), (4, 3), (8, 20)])
def test_sliding_window_work_differs_by_less_than_one_chunk(n, window):
    length = 64
    chunk = length // (2 * n)
    pairs = cp.attention_pairs(n, length, window=window)
    per_query = np.minimum(np.arange(length) + 1, window + 1)
    assert pairs.sum() == per_query.sum()
    assert pairs.max() - pairs.min() <= chunk * (window + 1)  # at most one chunk's work apart


def test_a_rank_cuts_the_sequence_arrays_keeps_the_whole_ones_and_adds_global_positions():
    n, length, rows = 2, 8, 3
    tokens = np.arange(rows * length).reshape(rows, length)
    batch = {"tokens": tokens, "segment_ids": tokens % 3, "weight": np.ones((rows,))}

    def one_rank(r):
        return cp.local_batch(batch, jnp.int32(r), n, length, whole=("segment_ids",))

    for r in range(n):
        local = jax.jit(one_rank, static_argnums=0)(r)
        idx = cp.local_indices(r, n, length)
        np.testing.assert_array_equal(local["tokens"], tokens[:, idx])
        np.testing.assert_array_equal(local["positions"], np.broadcast_to(idx, (rows, idx.size)))
        np.testing.assert_array_equal(local["segment_ids"], tokens % 3)  # whole
        np.testing.assert_array_equal(local["weight"], np.ones((rows,)))  # no sequence dimension
        np.testing.assert_array_equal(traced_local_indices(jnp.int32(r), n, length), idx)
        np.testing.assert_array_equal(split_sequence(jnp.asarray(tokens), jnp.int32(r), n), tokens[:, idx])


def test_a_batch_given_positions_keeps_them_cut_like_the_tokens():
    positions = np.array([[0, 1, 2, 0, 1, 0, 1, 2]])
    local = cp.local_batch({"tokens": positions * 10, "positions": positions}, jnp.int32(1), 2, 8)
    np.testing.assert_array_equal(local["positions"], positions[:, cp.local_indices(1, 2, 8)])


def test_a_sequence_that_does_not_cut_into_2cp_chunks_is_refused():
    with pytest.raises(ValueError, match=r"2 x cp = 8 equal chunks, but the sequence has 12 tokens"):
        cp.chunk_len(4, 12)
