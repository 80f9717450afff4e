"""Which gradients of parameters replicated over tp must be summed over tp, decided by JAX's types.

The engine differentiates each rank's program as it is (`shard_map(check_vma=False)`), with
Megatron's collectives (`jaxdist.tp`) carrying the activations' gradients. A parameter replicated
over tp then gets on each rank its whole gradient where it acted on values all ranks hold alike
(activations replicated over tp, or gathered), but only the rank's share where it acted on values
that differ per rank (its heads, its sequence chunk): those shares must be summed over tp.

JAX's varying-manual-axes types make that distinction. Under `shard_map(check_vma=True)`, wherever
a value invariant over tp meets a varying one JAX casts it to varying (`pvary`), and the transpose
of that cast sums the cotangent over tp. `tp_summed` traces a unit's backward once with those types
(never compiled) and counts, along every path from the output's cotangent to each input, the sums
over tp that JAX added (the sums of jaxdist's own layers carry `jaxdist.tp.SCOPE`; those run in the
real step too):

* none on any path: the rank's gradient is whole; leave it;
* exactly one on every path to a replicated parameter: the rank's share; sum it over tp;
* anything else (a parameter reached both ways, or an activation or a tp-split parameter reached
  through one) no single sum makes right: `tp_summed` raises, naming it, instead of letting the
  engine train on a wrong gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, Var
from jax.sharding import PartitionSpec as P

from jaxdist.compat import varying_axes
from jaxdist.tp.layers import SCOPE

# Bits of a cotangent's mask: it is reached along paths with no, one, or more of JAX's sums over tp.
NONE, ONE, MORE = 1, 2, 4
_LOOPS = ("scan", "while")  # a carried cotangent passes the body's sums again each iteration


class Undecidable(ValueError):
    """No single sum over tp makes a gradient right, or the trace cannot tell."""


def tp_summed(
    unit: Callable,
    ws: Mapping[int, jax.ShapeDtypeStruct],
    x,
    extra,
    *,
    mesh: jax.sharding.Mesh,
    axis: str,
    split: frozenset,
    x_varies: bool,
    out_may_vary: bool,
    names: Mapping[int, str],
    who: str,
) -> frozenset:
    """The keys of `ws` whose gradient through `unit` must be summed over `axis`.

    Args:
      unit: `unit(ws, x, extra) -> out`, one array (the rank's program of one unit, tp layers bound).
      ws: this rank's parameter pieces (shapes), by key.
      x: the unit's activation input (a shape) or None; its gradient must need no sum.
      extra: other inputs (shapes; the batch, variables), not differentiated.
      mesh, axis: the mesh and its tp axis.
      split: the keys of `ws` split over tp (each rank holds another piece).
      x_varies: `x` differs per tp rank (a sequence chunk).
      out_may_vary: `out` may differ per tp rank (else it must be the same on every rank).
      names: key -> parameter path, for errors; who: the unit, for errors.

    Raises:
      Undecidable: a gradient no single sum over tp makes right, or an output typed against the above.
    """
    found: list[frozenset] = []

    def body(ws, x, extra):
        ws = {k: _vary(w, axis) if k in split else w for k, w in ws.items()}
        if x is not None and x_varies:
            x = _vary(x, axis)
        out, vjp = jax.vjp(lambda ws, x: unit(ws, x, extra), ws, x)
        varies = axis in varying_axes(out)
        if varies and not out_may_vary:
            raise Undecidable(
                f"Parallel: {who} returns a value that differs per tp rank where every tp rank must hold the "
                "same (the loss; the activations between units without sequence parallelism); reduce or gather "
                "tp-split values with a tp layer first (a row layer, or a column layer with gather_output=True)"
            )
        ct = jnp.zeros(out.shape, out.dtype)
        closed = jax.make_jaxpr(vjp)(_vary(ct, axis) if varies else ct)
        masks = _walk(closed.jaxpr, [NONE], axis, who)
        keys = sorted(ws)
        x_mask = masks[len(keys)] if x is not None else 0
        found.append(_decide(dict(zip(keys, masks, strict=False)), x_mask, split, names, who))
        return jnp.zeros(())

    traced = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P(), check_vma=True)
    try:
        jax.eval_shape(traced, ws, x, extra)
    except Undecidable:
        raise
    except Exception as e:
        # the unit's own error (the real step would raise it too) surfaces as it is; else it is a type
        # error of the check_vma trace: say what was being decided
        def plain(ws, x, extra):
            unit(ws, x, extra)
            return jnp.zeros(())

        untyped = jax.shard_map(plain, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P(), check_vma=False)
        try:
            jax.eval_shape(untyped, ws, x, extra)
        except (TypeError, ValueError) as own:
            if not x_varies or x is None:
                raise
            # the documented cause under sequence parallelism: the unit's code meets the chunk of the tokens
            # with whole side inputs (a shape error in the user's code, which alone names neither)
            cause = f"{type(own).__name__}: {str(own).rstrip('.')}"
            raise ValueError(
                f"Parallel: {who} failed on this tp rank's chunk of the tokens (sequence_parallel: its activations "
                f"have shape {x.shape}, the batch's arrays stay whole): {cause}. If the chunk met a whole "
                "side input there, its first layer must be a tp layer (which gathers the tokens) before the "
                "activations meet the batch; or slice the batch to the chunk (pass sequence_dim=1 to fix it to "
                "the sequence), or turn sequence_parallel off (without it, the unit's own error shows as it is)"
            ) from own
        raise Undecidable(
            f"Parallel: cannot decide which gradients of {who} to sum over tp: tracing it under "
            f"shard_map(check_vma=True) failed with {type(e).__name__}: {e}"
        ) from e
    return found[0]


def _decide(masks: dict, x_mask: int, split: frozenset, names: Mapping[int, str], who: str) -> frozenset:
    if x_mask & ~NONE:
        raise Undecidable(
            f"Parallel: in {who}, the activations' gradient misses a sum over tp: the unit combines values "
            "replicated over tp with tp-split ones outside a tp layer (enter split values through a column "
            "layer and leave them through a row layer, or gather them)"
        )
    summed = set()
    for k, m in masks.items():
        if not m & ~NONE:
            continue
        if k not in split and m == ONE:
            summed.add(k)
            continue
        how = "both on values replicated over tp and on tp-split ones" if m & NONE else "on tp-split values"
        raise Undecidable(
            f"Parallel: in {who}, parameter {names[k]} acts {how}, so no single sum over tp gives its "
            "gradient; use it on one kind only (e.g. separate parameters), or leave its layer out of the "
            "tp plan"
        )
    return frozenset(summed)


def _vary(x, axis):
    return x if axis in varying_axes(x) else jax.lax.pcast(x, axis, to="varying")


def _walk(jaxpr, in_masks: list[int], axis: str, who: str) -> list[int]:
    """The mask of each output of `jaxpr` given its inputs' (constants reach nothing)."""
    env: dict = {}

    def read(v):
        return env.get(v, 0) if isinstance(v, Var) else 0

    for v, m in zip(jaxpr.invars, in_masks, strict=True):
        env[v] = m
    for eqn in jaxpr.eqns:
        masks = [read(v) for v in eqn.invars]
        if not any(masks):
            continue
        subs = sub_jaxprs(eqn.params)
        one_to_one = (
            len(subs) == 1
            and eqn.primitive.name not in _LOOPS
            and len(subs[0].invars) == len(eqn.invars)
            and len(subs[0].outvars) == len(eqn.outvars)
        )
        if one_to_one:
            outs = _walk(subs[0], masks, axis, who)
        elif subs and any(_sums(s, axis) for s in subs):
            raise Undecidable(
                f"Parallel: {who}: cannot tell which gradients to sum over tp through a {eqn.primitive.name} "
                "whose body mixes values replicated over tp with tp-split ones; move that code out of the "
                "control flow or out of the tp plan's reach"
            )
        else:
            m = _union(masks)
            outs = [_shift(m) if not subs and _is_sum(eqn, axis) else m] * len(eqn.outvars)
        for v, m in zip(eqn.outvars, outs, strict=True):
            env[v] = m
    return [read(v) for v in jaxpr.outvars]


def _union(masks) -> int:
    out = 0
    for m in masks:
        out |= m
    return out


def _shift(m: int) -> int:
    """Past one more sum: no sums -> one, one or more -> more."""
    return (ONE if m & NONE else 0) | (MORE if m & (ONE | MORE) else 0)


def _is_sum(eqn, axis: str) -> bool:
    """A reduction over tp that JAX added (from varying to invariant over tp, not in jaxdist's scope)."""
    if SCOPE in str(eqn.source_info.name_stack):
        return False
    varying_in = any(isinstance(v, Var) and axis in varying_axes(v.aval) for v in eqn.invars)
    invariant_out = any(hasattr(v.aval, "shape") and axis not in varying_axes(v.aval) for v in eqn.outvars)
    return varying_in and invariant_out


def _sums(jaxpr, axis: str) -> bool:
    for eqn in jaxpr.eqns:
        if _is_sum(eqn, axis):
            return True
        if any(_sums(j, axis) for j in sub_jaxprs(eqn.params)):
            return True
    return False


def sub_jaxprs(params: dict) -> list:
    """The jaxprs an equation holds (a jit's, a remat's, a custom rule's primal, a cond's branches)."""
    out = []
    for value in params.values():
        for j in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(j, ClosedJaxpr):
                out.append(j.jaxpr)
            elif isinstance(j, Jaxpr):
                out.append(j)
    return out
