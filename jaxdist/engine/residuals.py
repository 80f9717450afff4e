"""Which residuals of a `jax.vjp` are functions of the weights alone, so ZeRO-3 can keep a block's
activations for backward without keeping its gathered weights.

The residuals a forward `jax.vjp(fn, w, x)` holds (its leaves: `jax.vjp`'s function is a pytree of
them) include values computed from the weights `w` alone: `w` itself, its casts and transposes.
Kept until backward they would hold the gathered weights alive and defeat ZeRO-3. `weight_only`
finds them by a dependence analysis of the residuals' jaxpr; the engine keeps the others from the
forward and recomputes these from the weights gathered again for backward (`rebuild`). Values
that depend on neither `w` nor `x` (side inputs: the batch, RNG keys, constants) are kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Var

from jaxdist.tp.grads import sub_jaxprs

W, X = 1, 2  # a value reads the weights / the activations

# primitives that apply their one jaxpr once to their operands (a jit, a remat, a custom rule's
# primal): their outputs depend on their inputs as the inner jaxpr's do; any other primitive
# (loops, conds, unknown ones) is taken as a whole: each output reads every input
_CALLS = frozenset(
    {"jit", "pjit", "closed_call", "core_call", "checkpoint", "remat", "custom_jvp_call", "custom_vjp_call"}
)


def residual_leaves(fn: Callable, w, x, side) -> list:
    """The residuals of `jax.vjp(lambda w, x: fn(w, x, side), w, x, has_aux=True)`, flattened."""
    return jax.tree.leaves(jax.vjp(lambda w, x: fn(w, x, side), w, x, has_aux=True)[1])


def weight_only(fn: Callable, w, x, side) -> tuple[bool, ...]:
    """For each leaf of `residual_leaves(fn, w, x, side)`: True when it reads `w` and no leaf of `x`
    (a function of the weights and side inputs only, recomputable from the weights gathered again).

    `fn(w, x, side) -> (y, aux)`; the arguments may be arrays, tracers or ShapeDtypeStructs.
    """
    closed = jax.make_jaxpr(residual_leaves, static_argnums=0)(fn, w, x, side)
    n_w, n_x = len(jax.tree.leaves(w)), len(jax.tree.leaves(x))
    n_side = len(closed.jaxpr.invars) - n_w - n_x
    flags = _reads(closed.jaxpr, [W] * n_w + [X] * n_x + [0] * n_side)
    return tuple(bool(f & W) and not f & X for f in flags)


def weight_only_values(fn: Callable, w, x_aval, side, drop: Sequence[bool]) -> list:
    """The residuals flagged in `drop` (`weight_only`'s True), computed from `w` and `side` alone.

    Only the equations those residuals need run: a plain re-trace of the whole vjp would also issue
    the block's side-effecting ops on activations (the nccl backend's collectives are FFI calls XLA
    must keep), i.e. recompute the forward it exists to avoid. `x_aval` gives only x's shapes."""
    closed = jax.make_jaxpr(residual_leaves, static_argnums=0)(fn, w, x_aval, side)
    n_x = len(jax.tree.leaves(x_aval))
    args = jax.tree.leaves(w) + [None] * n_x + jax.tree.leaves(side)  # None: x, never read
    return _evaluate(closed.jaxpr, closed.consts, args, list(drop))


def _evaluate(jaxpr, consts, args: list, wanted: list[bool]) -> list:
    """The outputs of `jaxpr` flagged in `wanted`, running only the equations they need; a call (a
    jit, ...) whose other outputs read the activations (None in `args`) is evaluated inside, for
    the wanted outputs alone."""
    plan, _ = _plan(jaxpr, wanted)
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v):
        return env.get(v) if isinstance(v, Var) else v.val

    for eqn, outs in plan:
        ins = [read(v) for v in eqn.invars]
        if any(a is None for a in ins):
            body = _call_body(eqn)
            if body is None:
                raise AssertionError(f"residuals: {eqn.primitive} of a weight-only residual reads the activations")
            values = iter(_evaluate(*body, ins, outs))
            env.update((v, next(values)) for v, o in zip(eqn.outvars, outs, strict=True) if o)
            continue
        params = eqn.primitive.get_bind_params(eqn.params)
        subfuns, params = params if isinstance(params, tuple) else ((), params)  # older jax: (subfuns, params)
        with eqn.ctx.manager:
            out = eqn.primitive.bind(*subfuns, *ins, **params)
        env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out], strict=True))
    return [read(v) for v, want in zip(jaxpr.outvars, wanted, strict=True) if want]


def _plan(jaxpr, wanted: list[bool]) -> tuple[list, list[bool]]:
    """The equations of `jaxpr` the `wanted` outputs need, in order, each with the outputs of it
    needed, and which inputs they read (a call's: those its needed outputs read)."""
    needed = {v for v, want in zip(jaxpr.outvars, wanted, strict=True) if want and isinstance(v, Var)}
    plan = []
    for eqn in reversed(jaxpr.eqns):
        outs = [v in needed for v in eqn.outvars]
        if not any(outs):
            continue
        body = _call_body(eqn)
        ins = _plan(body[0], outs)[1] if body is not None else [True] * len(eqn.invars)
        plan.append((eqn, outs))
        needed.update(v for v, i in zip(eqn.invars, ins, strict=True) if i and isinstance(v, Var))
    return plan[::-1], [v in needed for v in jaxpr.invars]


def _call_body(eqn):
    """`(jaxpr, consts)` of a call equation that applies its one jaxpr to its operands, else None."""
    if eqn.primitive.name not in _CALLS:
        return None
    bodies = [j for j in eqn.params.values() if isinstance(j, (ClosedJaxpr, Jaxpr))]
    if len(bodies) != 1:
        return None
    body = bodies[0]
    jaxpr, consts = (body.jaxpr, body.consts) if isinstance(body, ClosedJaxpr) else (body, [])
    if len(jaxpr.invars) != len(eqn.invars) or len(jaxpr.outvars) != len(eqn.outvars):
        return None
    return jaxpr, consts


def rebuild(tree, kept: Sequence[Any], fresh: Sequence[Any]):
    """The forward's vjp (`tree`, its treedef) on its kept residuals, the dropped ones (None in
    `kept`) taken in order from `fresh` (`weight_only_values`, recomputed in backward)."""
    fresh = iter(fresh)
    leaves = [next(fresh) if k is None else k for k in kept]
    if next(fresh, None) is not None:
        raise AssertionError("residuals: backward recomputed more residuals than the forward dropped")
    return jax.tree.unflatten(tree, leaves)


def _reads(jaxpr, in_flags: list[int]) -> list[int]:
    """What each output of `jaxpr` reads (W | X bits) given its inputs' (constants and literals: 0)."""
    env = dict(zip(jaxpr.invars, in_flags, strict=True))

    def read(v):
        return env.get(v, 0) if isinstance(v, Var) else 0

    for eqn in jaxpr.eqns:
        flags = [read(v) for v in eqn.invars]
        subs = sub_jaxprs(eqn.params)
        if (
            eqn.primitive.name in _CALLS
            and len(subs) == 1
            and len(subs[0].invars) == len(flags)
            and len(subs[0].outvars) == len(eqn.outvars)
        ):
            outs = _reads(subs[0], flags)
        else:
            union = 0
            for f in flags:
                union |= f
            outs = [union] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]
