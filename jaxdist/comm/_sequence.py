"""`sequence`: the one primitive that ties values to an ordering token.

`sequence(values, token)` returns the same values and a new token, such that
none of the returned values is available before the token, and the returned
token is not available before any of the values. Each output keeps its own
input's type (shard_map's varying axes included), so sequencing never changes
what a user may do with a value.

Lowering: an optimization barrier. XLA's GPU and TPU compilers drop barriers
only after scheduling, so the barrier fixes the order there at no cost. XLA's
CPU compiler drops them before scheduling, so on CPU the tie is also made of
data XLA cannot see through: each value passes a select on a predicate
computed from the token that is never true, and the new token is a max over
one element of each value. That costs one pass over the values, on CPU only.
The new token is computed once (`_materialized`), so a tie never reads values
tied before it and keeps none of them alive.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jaxdist.compat import hlo_optimization_barrier

sequence_p = Primitive("jaxdist_sequence")
sequence_p.multiple_results = True


def sequence(values: tuple, token: jax.Array, *, cpu_only: bool = False) -> tuple[tuple, jax.Array]:
    """Tie `values` (a tuple of arrays) and `token` (a uint8 scalar) together.

    With `cpu_only=True` the tie exists on CPU only and is the identity on
    other platforms (see `Backend.issued`).
    """
    if not values:
        return values, token
    *out, new_token = sequence_p.bind(*values, token, cpu_only=cpu_only)
    return tuple(out), new_token


@sequence_p.def_abstract_eval
def _abstract_eval(*avals, cpu_only):
    return list(avals)


def _cpu_tie(*args, cpu_only=False):
    *values, token = args
    # The token is kept in {0, 1}, so `token == 255` is never true, but XLA cannot know that.
    never = token == 255
    tied = [v if v.size == 0 else lax.select(jnp.broadcast_to(never, v.shape), _flip(v), v) for v in values]
    for v in values:
        if v.size:
            token = jnp.maximum(token, (v.reshape(-1)[0] > 1).astype(token.dtype))
    return (*tied, _materialized(token))


def _materialized(token):
    """The token through a float sqrt ({0, 1} -> {0, 1}). XLA's fusion copies cheap scalar code into
    every consumer but does not duplicate an expensive op, so the new token is computed once, here:
    without it each later tie recomputed the whole chain of maxima and read every value ever tied,
    which kept each of them (e.g. every gathered unit of a step) alive to the end of the program."""
    return (jnp.sqrt(token.astype(jnp.float32)) > 0.5).astype(token.dtype)


sequence_p.def_impl(_cpu_tie)


def _flip(v):
    return ~v if v.dtype == jnp.bool_ else -v


def _lower_barrier(ctx, *args, cpu_only):
    return list(args) if cpu_only else hlo_optimization_barrier(args)


def _lower_cpu(ctx, *args, cpu_only):
    args = hlo_optimization_barrier(args)
    return mlir.lower_fun(_cpu_tie, multiple_results=True)(ctx, *args)


mlir.register_lowering(sequence_p, _lower_barrier)
mlir.register_lowering(sequence_p, _lower_cpu, platform="cpu")


def _jvp(primals, tangents, cpu_only):
    # Tangents need no ordering of their own: they pass straight through,
    # which keeps the rule linear and transposable.
    return sequence_p.bind(*primals, cpu_only=cpu_only), list(tangents)


ad.primitive_jvps[sequence_p] = _jvp


def _batch(args, dims, cpu_only):
    return sequence_p.bind(*args, cpu_only=cpu_only), list(dims)


batching.primitive_batchers[sequence_p] = _batch
