"""The one schedule core: a loop over units with communication `depth` units ahead.

For each unit (a repeated block) in order: its weights are fetched by an async
op started `depth` units earlier; the unit computes; what it emits (its
gradient) goes into an async op that is finished `depth` units later. FSDP's
gather/reduce-scatter and tensor parallelism's weight prefetch are this loop.

The bound on live buffers is structural: the loop state holds exactly `depth`
in-flight fetches and at most `depth` in-flight emits, so a unit can only be
computed with `depth + 1` fetched units in existence, and a new emit is
started only after the oldest one has been waited. There is no other path.

The first and last `depth` iterations are unrolled (nothing to finish yet /
nothing left to fetch) and the middle is one `lax.scan`; `unroll=True` unrolls
everything (handy for reading a schedule), and so does an op whose handles may
not cross a loop boundary (the nccl backend's: XLA could copy the in-flight
buffer as a loop carry before NCCL wrote it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax import lax

from jaxdist import comm
from jaxdist.comm import op_site


def check_buffers(who: str, buffers, prefetch) -> None:
    """Raise unless `prefetch` units ahead fit in `buffers` gathered units (the loop's structural bound)."""
    if not isinstance(buffers, int) or buffers < 2:
        raise ValueError(f"{who}: buffers must be an int >= 2 (one unit computing, one arriving), got {buffers!r}")
    if not isinstance(prefetch, int) or prefetch < 1:
        raise ValueError(f"{who}: prefetch must be an int >= 1, got {prefetch!r}")
    if prefetch + 1 > buffers:
        raise ValueError(
            f"{who}: prefetch={prefetch} keeps {prefetch + 1} gathered units alive but buffers={buffers}; "
            f"raise buffers to {prefetch + 1} or lower prefetch"
        )


@dataclasses.dataclass(frozen=True)
class AsyncOp:
    """An async op as two functions: `start(x, token) -> (handle, token)`, `wait(handle, token) -> (y, token)`."""

    start: Callable
    wait: Callable
    name: str
    crosses_loops: bool = True  # False: handles may not be carried through a scan (the nccl backend's)


def kept(name: str) -> AsyncOp:
    """A "fetch" of weights already at hand (kept from the forward): starting it holds them, waiting
    returns them. Backward runs the same loop whether it gathers again or reads what it kept."""
    return AsyncOp(lambda w, tok: ((w,), tok), lambda h, tok: (h[0], tok), name)


def pipelined_loop(
    compute: Callable,
    carry,
    n: int,
    token: comm.Token,
    *,
    fetch: AsyncOp,
    fetch_input: Callable[[Any, Any], Any],
    emit: AsyncOp | None = None,
    finish: Callable | None = None,
    acc=None,
    depth: int = 1,
    reverse: bool = False,
    unroll: bool = False,
):
    """Run `compute` over units 0..n-1 (n-1..0 with `reverse`).

    Args:
      compute: `compute(unit, fetched, carry) -> (carry, emitted, y)`; `unit`
        is an int or a traced index; `emitted` is None when `emit` is None.
      carry: the loop carry (e.g. activations); tied after each fetch's issue.
      n: the number of units.
      token: the ordering token.
      fetch: what brings unit `u`'s weights: started on `fetch_input(u, acc)`
        (`acc` as `finish` left it, so a buffer updated in place can also be
        the one fetched from).
      emit: what carries each unit's `emitted` away (e.g. a reduce-scatter).
      finish: `finish(unit, done, acc, token) -> (acc, token)`, applied to each
        emit's result as soon as it is waited; `acc` is carried through the
        loop (so it can be updated in place, e.g. one unit's slice of a
        donated buffer) and returned as `emitted`. Default: stack the results.
      acc: the initial accumulator for `finish`.
      depth: how many units ahead fetches start (and how late emits finish);
        `depth + 1` fetched units exist at most.
      reverse: run from the last unit to the first.

    Returns:
      `(carry, token, emitted, ys)`, `emitted` and `ys` stacked in unit order.
    """
    if depth < 1 or depth >= n + 1:
        raise ValueError(f"pipelined_loop: depth must be in 1..{n} for {n} units, got {depth}")
    # a backend whose handles cannot be loop carries gets the whole loop unrolled
    unroll = unroll or not all(op.crosses_loops for op in (fetch, emit) if op is not None)

    def order(k):
        return n - 1 - k if reverse else k

    stack = finish is None
    if stack:

        def finish(unit, done, acc, tok):  # the done value is the output
            return done, tok

    def one(k, state, fetch_next: bool, pop: bool):
        carry, tok, fetches, emits, acc = state
        unit = order(k)
        carry, tok = comm.tie(carry, tok)  # fetches for later units start after the previous unit computed
        with op_site(fetch.name):
            value, tok = fetch.wait(fetches[0], tok)
            fetches = fetches[1:]
            if fetch_next:
                h, tok = fetch.start(fetch_input(order(k + depth), acc), tok)
                fetches = (*fetches, h)
        carry, tok = comm.tie(carry, tok)  # the unit computes only after the next fetch was issued
        carry, out, y = compute(unit, value, carry)
        done = None
        if emit is not None:
            with op_site(emit.name):
                if pop:
                    done, tok = emit.wait(emits[0], tok)
                    emits = emits[1:]
            if pop:
                out_acc, tok = finish(order(k - depth), done, acc, tok)
                done, acc = (out_acc, acc) if stack else (None, out_acc)
            with op_site(emit.name):
                h, tok = emit.start(out, tok)
                emits = (*emits, h)
            carry, tok = comm.tie(carry, tok)  # the next unit computes only after this emit was issued
        return (carry, tok, fetches, emits, acc), done, y

    fetches = []
    tok = token
    with op_site(fetch.name):
        for k in range(depth):
            h, tok = fetch.start(fetch_input(order(k), acc), tok)
            fetches.append(h)
    state = (carry, tok, tuple(fetches), (), acc)
    dones, ys = [], []

    head = range(n) if unroll else range(min(depth, n))
    for k in head:
        state, done, y = one(k, state, fetch_next=k + depth < n, pop=k >= depth)
        dones.append(done)
        ys.append(y)
    middle_end = n if unroll else max(len(head), n - depth)
    if middle_end > len(head):

        def body(state, k):
            state, done, y = one(k, state, fetch_next=True, pop=True)
            return state, (done, y)

        state, (done_stack, y_stack) = lax.scan(body, state, jax.numpy.arange(len(head), middle_end))
        dones.append(("stacked", done_stack))
        ys.append(("stacked", y_stack))
    for k in range(middle_end, n):
        state, done, y = one(k, state, fetch_next=False, pop=True)
        dones.append(done)
        ys.append(y)
    carry, tok, fetches, emits, acc = state
    assert not fetches
    if emit is not None:
        for j, h in enumerate(emits):
            with op_site(emit.name):
                done, tok = emit.wait(h, tok)
            out_acc, tok = finish(order(n - len(emits) + j), done, acc, tok)
            if stack:
                dones.append(out_acc)
            else:
                acc = out_acc
    if emit is None:
        emitted = None
    elif stack:
        emitted = _stack_in_unit_order([d for d in dones if d is not None], reverse)
    else:
        emitted = acc
    return carry, tok, emitted, _stack_in_unit_order(ys, reverse)


def _stack_in_unit_order(items: list, reverse: bool):
    """Stack per-iteration values (some already stacked by the scan) along a new leading axis."""
    parts = []
    for item in items:
        if isinstance(item, tuple) and len(item) == 2 and item[0] == "stacked":
            parts.append(item[1])
        else:
            parts.append(jax.tree.map(lambda x: x[None], item))
    if not parts or all(p is None for p in parts):
        return None
    stacked = jax.tree.map(lambda *xs: jax.numpy.concatenate(xs), *parts)
    return jax.tree.map(lambda x: x[::-1], stacked) if reverse else stacked
