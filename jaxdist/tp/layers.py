"""Megatron-style tensor parallelism: the layer math, as functions inside `shard_map`.

Activations are replicated over the `tp` axis (or split along the sequence
with sequence parallelism); weights are split over it. A column-parallel
linear splits output features, a row-parallel one input features and sums the
partial products across `tp`; attention splits heads; the embedding and the
cross-entropy split the vocabulary, so full logits never exist.

The communication is four differentiable functions (Megatron's f and g, and
their sequence-parallel forms), each a `jaxdist.comm` collective in forward
and its transpose in backward, so they work with either comm backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxdist import comm
from jaxdist.compat import varying_axes

# The name scope of every collective these layers issue in backward. Under `shard_map(check_vma=True)`
# JAX sums a gradient over an axis wherever a value invariant over it met a varying one; the sums
# these layers make themselves carry this scope, so `jaxdist.tp.grads` can tell JAX's from ours.
SCOPE = "jaxdist_tp"


def _reduce(x, axis, backend):
    return comm.all_reduce(x, axis, comm.token("tp"), op="sum", backend=backend)[0]


def _vary(x, axis):
    """Type `x` as varying over `axis` under check_vma (the identity without it: no communication)."""
    return x if axis in varying_axes(x) else jax.lax.pcast(x, axis, to="varying")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def copy_to_tp(x, axis: str, backend: str | None = None):
    """Identity in forward; sums the gradient over `axis` in backward (Megatron's f)."""
    return _vary(x, axis)


def _copy_bwd(axis, backend, _, g):
    with jax.named_scope(SCOPE):
        return (_reduce(g, axis, backend),)


copy_to_tp.defvjp(lambda x, axis, backend: (_vary(x, axis), None), _copy_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def reduce_from_tp(x, axis: str, backend: str | None = None):
    """Sums partial results over `axis` in forward; identity in backward (Megatron's g)."""
    return _reduce(x, axis, backend)


reduce_from_tp.defvjp(
    lambda x, axis, backend: (_reduce(x, axis, backend), None), lambda axis, backend, _, g: (_vary(g, axis),)
)


def _gather_seq(x, axis, backend, dim):
    return comm.all_gather(x, axis, comm.token("tp"), axis=dim, backend=backend)[0]


def _scatter_seq(x, axis, backend, dim):
    return comm.reduce_scatter(x, axis, comm.token("tp"), op="sum", scatter_axis=dim, backend=backend)[0]


def gather_whole(x, axis: str, dim: int, backend: str | None = None):
    """All-gather dimension `dim` over `axis` into a value every rank holds whole.

    Under check_vma the result is typed invariant over `axis` (what it is; `comm.all_gather` follows
    `lax.all_gather`, typed varying), made as a sum of zero-padded pieces: that runs only in
    `jaxdist.tp.grads`'s type trace, which is never compiled. Otherwise it is `comm.all_gather`.
    """
    if axis not in varying_axes(x):
        return comm.all_gather(x, axis, comm.token("tp"), axis=dim, backend=backend)[0]
    n = x.shape[dim]
    shape = (*x.shape[:dim], n * jax.lax.axis_size(axis), *x.shape[dim + 1 :])
    placed = jax.lax.dynamic_update_slice_in_dim(jnp.zeros(shape, x.dtype), x, jax.lax.axis_index(axis) * n, dim)
    return jax.lax.psum(placed, axis)


# Sequence parallelism splits one token dimension `dim` of the activations over tp: the
# sequence (1), or the leading (batch) dimension, whose collectives need no transposes on GPU.


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gather_sequence(x, axis: str, backend: str | None = None, dim: int = 1):
    """Sequence parallelism: all-gather the token dim `dim` in forward, reduce-scatter it in backward."""
    return _gather_seq(x, axis, backend, dim)


def _gather_seq_bwd(axis, backend, dim, _, g):
    with jax.named_scope(SCOPE):
        return (_scatter_seq(g, axis, backend, dim),)


gather_sequence.defvjp(lambda x, axis, backend, dim: (_gather_seq(x, axis, backend, dim), None), _gather_seq_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def scatter_sequence(x, axis: str, backend: str | None = None, dim: int = 1):
    """Sequence parallelism: reduce-scatter the token dim `dim` in forward, all-gather it in backward."""
    return _scatter_seq(x, axis, backend, dim)


def _scatter_seq_bwd(axis, backend, dim, _, g):
    with jax.named_scope(SCOPE):
        return (_gather_seq(g, axis, backend, dim),)


scatter_sequence.defvjp(lambda x, axis, backend, dim: (_scatter_seq(x, axis, backend, dim), None), _scatter_seq_bwd)


def column_linear(x, kernel, bias=None):
    """`x @ kernel + bias` with `kernel` (and `bias`) holding this rank's output features."""
    y = jnp.einsum("...d,df->...f", x, kernel)
    return y if bias is None else y + bias


def row_linear(
    x, kernel, axis: str, bias=None, *, backend=None, sequence_parallel: bool = False, sequence_dim: int = 1
):
    """`x @ kernel` over this rank's input features, summed over `axis`, then `+ bias` (replicated).

    With sequence parallelism the sum is a reduce-scatter over the token dim `sequence_dim`.
    """
    partial = jnp.einsum("...f,fd->...d", x, kernel)
    if sequence_parallel:
        y = scatter_sequence(partial, axis, backend, sequence_dim)
    else:
        y = reduce_from_tp(partial, axis, backend)
    return y if bias is None else y + bias


def vocab_parallel_embed(tokens, table, axis: str, *, backend=None):
    """Embedding lookup with the vocabulary split over `axis`: `table` holds rows
    [rank * V/tp, (rank + 1) * V/tp); other ranks' tokens contribute zeros, then a sum."""
    rows = table.shape[0]
    start = jax.lax.axis_index(axis) * rows
    local = tokens - start
    inside = (local >= 0) & (local < rows)
    emb = jnp.take(table, jnp.where(inside, local, 0), axis=0) * inside[..., None].astype(table.dtype)
    return reduce_from_tp(emb, axis, backend)


def vocab_parallel_cross_entropy(logits, labels, axis: str, *, backend=None):
    """Per-token cross-entropy from this rank's vocabulary slice of the logits (float32 math).

    Only per-token scalars cross `axis` (max, sum of exponentials, target logit),
    never the logits themselves.
    """
    logits = logits.astype(jnp.float32)
    cols = logits.shape[-1]
    start = jax.lax.axis_index(axis) * cols
    # max over the whole vocabulary, as a constant shift (it needs no gradient)
    local_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
    shift = comm.all_reduce(local_max, axis, comm.token("tp"), op="max", backend=backend)[0]
    shifted = logits - shift[..., None]
    sum_exp = reduce_from_tp(jnp.sum(jnp.exp(shifted), axis=-1), axis, backend)
    local = labels - start
    inside = (local >= 0) & (local < cols)
    picked = jnp.take_along_axis(shifted, jnp.where(inside, local, 0)[..., None], axis=-1)[..., 0]
    target = reduce_from_tp(jnp.where(inside, picked, 0.0), axis, backend)
    return jnp.log(sum_exp) - target


def _split_seq(x, axis, dim):
    n = x.shape[dim] // comm_axis_size(axis)
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis) * n, n, axis=dim)


def comm_axis_size(axis: str) -> int:
    return jax.lax.psum(1, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def split_sequence(x, axis: str, backend: str | None = None, dim: int = 1):
    """Sequence parallelism: keep this rank's chunk of the token dim `dim` of a replicated
    `x` in forward; all-gather the gradient in backward."""
    return _split_seq(x, axis, dim)


def _split_seq_bwd(axis, backend, dim, _, g):
    with jax.named_scope(SCOPE):
        return (gather_whole(g, axis, dim, backend),)


split_sequence.defvjp(lambda x, axis, backend, dim: (_split_seq(x, axis, dim), None), _split_seq_bwd)


# -- Flax NNX layers over the same math ------------------------------------------------
# Each holds this rank's piece of the weight (call them inside `shard_map`, where the
# arrays are local); `split` cuts a rank's piece out of a full weight.

from flax import nnx  # noqa: E402


class ColumnParallelLinear(nnx.Module):
    """`y = x @ W + b` with this rank's `out_features / tp` columns; output split over `tp`."""

    def __init__(self, kernel, bias, axis: str, *, backend: str | None = None, sequence_parallel: bool = False):
        self.kernel, self.bias = nnx.Param(kernel), nnx.Param(bias) if bias is not None else None
        self.axis, self.backend, self.sequence_parallel = axis, backend, sequence_parallel

    @staticmethod
    def split(kernel, bias, rank: int, size: int):
        n = kernel.shape[-1] // size

        def cut(a):
            return a[..., rank * n : (rank + 1) * n]

        return cut(kernel), None if bias is None else cut(bias)

    def __call__(self, x):
        if self.sequence_parallel:
            x = gather_sequence(x, self.axis, self.backend)
        else:
            x = copy_to_tp(x, self.axis, self.backend)
        return column_linear(x, self.kernel[...], None if self.bias is None else self.bias[...])


class RowParallelLinear(nnx.Module):
    """`y = sum over tp of x_r @ W_r, + b`: input split over `tp`, output replicated (or sequence-split)."""

    def __init__(self, kernel, bias, axis: str, *, backend: str | None = None, sequence_parallel: bool = False):
        self.kernel, self.bias = nnx.Param(kernel), nnx.Param(bias) if bias is not None else None
        self.axis, self.backend, self.sequence_parallel = axis, backend, sequence_parallel

    @staticmethod
    def split(kernel, bias, rank: int, size: int):
        n = kernel.shape[0] // size
        return kernel[rank * n : (rank + 1) * n], bias

    def __call__(self, x):
        bias = None if self.bias is None else self.bias[...]
        return row_linear(
            x, self.kernel[...], self.axis, bias, backend=self.backend, sequence_parallel=self.sequence_parallel
        )


class VocabParallelEmbed(nnx.Module):
    """Token embedding with this rank's `vocab / tp` rows; output replicated over `tp`."""

    def __init__(self, table, axis: str, *, backend: str | None = None):
        self.table, self.axis, self.backend = nnx.Param(table), axis, backend

    @staticmethod
    def split(table, rank: int, size: int):
        n = table.shape[0] // size
        return table[rank * n : (rank + 1) * n]

    def __call__(self, tokens):
        return vocab_parallel_embed(tokens, self.table[...], self.axis, backend=self.backend)
