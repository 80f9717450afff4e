"""Evaluate a traced step equation by equation, with communication slotted in.

This is how jaxdist overlaps communication with the compute of a model it did
not write: trace `value_and_grad(loss)` to a jaxpr, then evaluate it here. A
`InterleaveSchedule` is told just before the first equation that reads a group of lazy
inputs (for example one bucket of sharded parameters, which it then gathers)
and just after the last equation that produces a group of outputs (one bucket
of gradients, which it then reduces). It may tie the next equation's inputs to
its token, so the order it chooses is data flow that XLA has to keep.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from jax.extend.core import ClosedJaxpr, Literal


class Lazy:
    """Placeholder for an input the schedule supplies on first use."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "LAZY"


LAZY = Lazy()


class InterleaveSchedule:
    """Callbacks of `eval_interleaved`; the default does nothing."""

    def fetch(self, group: Hashable, ties: tuple) -> tuple[Mapping[int, Any], tuple]:
        """Supply every lazy input of `group` (by input index); may tie `ties` to its token."""
        raise NotImplementedError

    def ready(self, group: Hashable, values: Mapping[int, Any]) -> None:
        """All outputs of `group` (by output index) exist."""

    def before(self, inputs: tuple) -> tuple:
        """Called with each equation's array inputs; may tie them to the schedule's token."""
        return inputs


def first_use_order(closed: ClosedJaxpr, lazy: Mapping[int, Hashable], unread: bool = True) -> list[Hashable]:
    """The groups of `lazy` inputs in the order equations first read them (then the unread ones, if `unread`)."""
    group_of = {closed.jaxpr.invars[i]: g for i, g in lazy.items()}
    order: list[Hashable] = []
    for eqn in closed.jaxpr.eqns:
        for v in eqn.invars:
            g = None if isinstance(v, Literal) else group_of.get(v)
            if g is not None and g not in order:
                order.append(g)
    if not unread:
        return order
    return order + [g for g in dict.fromkeys(lazy.values()) if g not in order]


def eval_interleaved(
    closed: ClosedJaxpr,
    args: Sequence,
    schedule: InterleaveSchedule,
    *,
    lazy: Mapping[int, Hashable] = {},  # noqa: B006 - read only
    watch: Mapping[int, Hashable] = {},  # noqa: B006 - read only
) -> list:
    """Evaluate `closed` on `args`, calling `schedule` around the equations.

    Args:
      closed: the traced function.
      args: one value per input; inputs listed in `lazy` may be `LAZY`.
      schedule: the callbacks.
      lazy: input index -> group, for inputs supplied by `schedule.fetch`.
      watch: output index -> group, for outputs reported by `schedule.ready`.

    Returns:
      The outputs.
    """
    jaxpr = closed.jaxpr
    env: dict = {}
    lazy_group = {jaxpr.invars[i]: g for i, g in lazy.items()}
    members: dict[Hashable, list[int]] = {}
    for i, g in lazy.items():
        members.setdefault(g, []).append(i)

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for v, c in zip(jaxpr.constvars, closed.consts, strict=True):
        env[v] = c
    for i, (v, a) in enumerate(zip(jaxpr.invars, args, strict=True)):
        if a is LAZY and i not in lazy:
            raise ValueError(f"input {i} is LAZY but belongs to no lazy group")
        if a is not LAZY:
            env[v] = a

    waiting: dict[Hashable, set[int]] = {}
    for i, g in watch.items():
        waiting.setdefault(g, set()).add(i)

    def report_ready():
        for g in [g for g, outs in waiting.items() if all(_known(jaxpr.outvars[i], env) for i in outs)]:
            outs = waiting.pop(g)
            schedule.ready(g, {i: read(jaxpr.outvars[i]) for i in sorted(outs)})

    report_ready()
    for eqn in jaxpr.eqns:
        unread = [v for v in eqn.invars if not isinstance(v, Literal) and v in lazy_group and v not in env]
        for g in dict.fromkeys(lazy_group[v] for v in unread):
            ties = tuple(v for v in eqn.invars if not isinstance(v, Literal) and v in env)
            values, tied = schedule.fetch(g, tuple(env[v] for v in ties))
            if set(values) != set(members[g]):
                raise RuntimeError(f"schedule.fetch({g!r}) returned inputs {sorted(values)}, expected {members[g]}")
            env.update(zip(ties, tied, strict=True))
            for i, value in values.items():
                env[jaxpr.invars[i]] = value
        arrays = [v for v in eqn.invars if not isinstance(v, Literal)]
        env.update(zip(arrays, schedule.before(tuple(env[v] for v in arrays)), strict=True))
        out = _bind(eqn, [read(v) for v in eqn.invars])
        outs = out if eqn.primitive.multiple_results else [out]
        for v, o in zip(eqn.outvars, outs, strict=True):
            env[v] = o
        if waiting:
            report_ready()
    return [read(v) for v in jaxpr.outvars]


def _bind(eqn, args):
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns = ()
    if isinstance(params, tuple):  # jax < 0.10 returns (subfuns, params)
        subfuns, params = params
    ctx = getattr(getattr(eqn, "ctx", None), "manager", contextlib.nullcontext())
    with ctx:
        return eqn.primitive.bind(*subfuns, *args, **params)


def _known(v, env) -> bool:
    return isinstance(v, Literal) or v in env
