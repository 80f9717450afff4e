"""The public collectives: checks, token sequencing, then the backend.

A tuple (or list) of arrays in place of `x` makes a grouped op: one collective of that kind over
every array in place, with one handle and a tuple of results. The nccl backend issues them inside one
NCCL group (one launch); the xla backend starts them together, between the same two barriers, where
XLA's combiners merge them. A bucket of parameters is reduced this way without copies into one flat
buffer.

Sequencing is data flow. An op's input passes through an optimization barrier
together with the incoming token, so the op cannot begin before everything
earlier on the chain; its result passes through another barrier with the token,
so everything later on the chain waits for it. An async start returns a token
that follows the op's issue, not its completion (see `Backend.issued`), which
is what lets later compute overlap it and lets code tied to that token run only
after the op was issued.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from jaxdist.comm import _checks as checks
from jaxdist.comm._backend import Backend, get_backend
from jaxdist.comm._sequence import sequence
from jaxdist.comm._types import Handle, Token

_REDUCE_OPS = {"all_reduce": ("sum", "mean", "max", "min"), "reduce_scatter": ("sum", "mean")}


def _sequenced(value, tok: Token):
    """Tie `value` (an array or tuple of arrays) to the token: neither is available before both are."""
    is_tuple = isinstance(value, tuple)
    values, t = sequence(value if is_tuple else (value,), tok.value)
    return (values if is_tuple else values[0]), Token(t, tok.chain)


def _prepare(kind: str, x, axis_name, tok, backend: str | None, **params) -> tuple[Backend, dict]:
    """Check every argument of op `kind` and return its backend and normalized params."""
    checks.check_token(tok, kind)
    x = checks.check_array(x, kind)
    be = get_backend(backend)
    size = checks.axis_size(axis_name)
    # `op` is checked whenever the kind takes one: op=None must not fall through to a sum
    reduce_op = checks.check_reduce_op(params["op"], _REDUCE_OPS[kind], kind) if kind in _REDUCE_OPS else None
    checks.check_dtype(x.dtype, reduce_op, be.dtypes, be.name, kind)
    if kind == "all_gather":
        if not isinstance(params["tiled"], bool):
            raise TypeError(f"all_gather: tiled must be a bool, got {params['tiled']!r}")
        # untiled gather inserts a new dimension, so one more position is valid
        rank = x.ndim if params["tiled"] else x.ndim + 1
        params["axis"] = checks.check_dim(params["axis"], max(rank, 1), kind, "axis")
        if params["tiled"] and x.ndim == 0:
            raise ValueError("all_gather: a tiled gather needs an array of rank >= 1; pass tiled=False for scalars")
    elif kind == "reduce_scatter":
        if x.ndim == 0:
            raise ValueError("reduce_scatter: needs an array of rank >= 1")
        dim = checks.check_dim(params["scatter_axis"], x.ndim, kind, "scatter_axis")
        checks.check_divisible(x.shape, dim, size, kind, axis_name)
        params["scatter_axis"] = dim
    elif kind == "sendrecv":
        params["perm"] = checks.check_perm(params["perm"], size, axis_name)
    params["size"] = size
    return be, params


def _run(kind, x, axis_name, tok, backend, **params):
    if _is_group(x):  # a group's sync form: started and waited at once
        handle, tok = _start(kind, x, axis_name, tok, backend, **params)
        return wait(handle, tok)
    be, params = _prepare(kind, x, axis_name, tok, backend, **params)
    x, tok = _sequenced(x, tok)
    result = getattr(be, kind)(x, axis_name, **params)
    return _sequenced(result, tok)


def _start(kind, x, axis_name, tok, backend, **params):
    if _is_group(x):
        return _start_group(kind, x, axis_name, tok, backend, params)
    be, params = _prepare(kind, x, axis_name, tok, backend, **params)
    x, tok = _sequenced(x, tok)
    buffers = be.start(kind, x, axis_name, params)  # may add what its finish needs to params
    buffers, value = be.issued(tuple(buffers), tok.value)
    frozen = tuple(sorted({**params, "axis_name": axis_name}.items()))
    return Handle(buffers, kind, tok.chain, be.name, frozen), Token(value, tok.chain)


def _is_group(x) -> bool:
    return isinstance(x, tuple | list)


# the parameters that may differ between the arrays of a group (an int, or one per array)
_PER_ARRAY = {"all_gather": "axis", "reduce_scatter": "scatter_axis"}


def _start_group(kind, xs, axis_name, tok, backend, params):
    if kind == "sendrecv":
        raise TypeError("sendrecv: takes one array; a group holds collectives (all_reduce, all_gather, reduce_scatter)")
    if not xs:
        raise ValueError(f"{kind}: a group needs at least one array, got an empty {type(xs).__name__}")
    per_array = _PER_ARRAY.get(kind)
    values = params.get(per_array) if per_array else None
    if per_array and _is_group(values) and len(values) != len(xs):
        raise ValueError(f"{kind}: {per_array} has {len(values)} entries for a group of {len(xs)} arrays")
    prepared = []
    for i, x in enumerate(xs):
        own = dict(params)
        if per_array and _is_group(values):
            own[per_array] = values[i]
        try:
            be, own = _prepare(kind, x, axis_name, tok, backend, **own)
        except (TypeError, ValueError) as e:  # name the array of the group the check is about
            raise type(e)(str(e).replace(f"{kind}:", f"{kind} (array {i} of the group):", 1)) from None
        prepared.append(own)
    xs, tok = _sequenced(tuple(xs), tok)
    buffers = be.start_group(kind, xs, axis_name, prepared)  # may add what its finish needs to each params
    buffers, value = be.issued(tuple(buffers), tok.value)
    frozen = (("axis_name", axis_name), ("group", tuple(tuple(sorted(p.items())) for p in prepared)))
    return Handle(buffers, kind, tok.chain, be.name, frozen), Token(value, tok.chain)


def all_gather(
    x, axis_name, token: Token, *, axis: int | Sequence[int] = 0, tiled: bool = True, backend: str | None = None
):
    """Gather `x` from every rank of `axis_name`; returns `(result, token)`.

    With `tiled=True` the shards are concatenated along `axis`; otherwise they
    are stacked along a new dimension at `axis`. Shards come in rank order; along
    a tuple of axes ranks are numbered in tuple order, like `lax.axis_index`.
    A tuple of arrays gathers each (one group; `axis` an int or one per array) and returns a tuple.
    """
    return _run("all_gather", x, axis_name, token, backend, axis=axis, tiled=tiled)


def reduce_scatter(
    x, axis_name, token: Token, *, op: str = "sum", scatter_axis: int | Sequence[int] = 0, backend: str | None = None
):
    """Reduce `x` over `axis_name` and keep this rank's slice of `scatter_axis`.

    `op` is "sum" or "mean"; returns `(result, token)`. Rank r keeps slice r;
    along a tuple of axes ranks are numbered in tuple order, like `lax.axis_index`.
    A tuple of arrays reduces each (one group; `scatter_axis` an int or one per array) and returns a tuple.
    """
    return _run("reduce_scatter", x, axis_name, token, backend, op=op, scatter_axis=scatter_axis)


def all_reduce(x, axis_name, token: Token, *, op: str = "sum", backend: str | None = None):
    """Reduce `x` over `axis_name` with "sum", "mean", "max" or "min"; returns `(result, token)`.

    A tuple of arrays reduces each (one group) and returns a tuple."""
    return _run("all_reduce", x, axis_name, token, backend, op=op)


def sendrecv(x, axis_name, token: Token, *, perm: Sequence[tuple[int, int]], backend: str | None = None):
    """Send `x` along the `(src, dst)` pairs of `perm`, like `lax.ppermute`.

    Ranks are ints. Along a tuple of axes they are numbered in tuple order, as
    `lax.axis_index(axis_name)` and `all_gather` number them: for `("b", "a")`
    rank = b_index * size_a + a_index, whatever the mesh's axis order (unlike
    `lax.ppermute`, which numbers in mesh order). A rank that receives nothing
    gets zeros; a rank may only send, only receive, or both. Returns `(result, token)`.
    """
    return _run("sendrecv", x, axis_name, token, backend, perm=perm)


def all_gather_start(
    x, axis_name, token: Token, *, axis: int | Sequence[int] = 0, tiled: bool = True, backend: str | None = None
):
    """Begin an `all_gather` (of one array, or a group: a tuple of arrays); returns `(handle, token)`.
    Finish it with `wait`."""
    return _start("all_gather", x, axis_name, token, backend, axis=axis, tiled=tiled)


def reduce_scatter_start(
    x, axis_name, token: Token, *, op: str = "sum", scatter_axis: int | Sequence[int] = 0, backend: str | None = None
):
    """Begin a `reduce_scatter` (of one array, or a group: a tuple of arrays); returns `(handle, token)`.
    Finish it with `wait`."""
    return _start("reduce_scatter", x, axis_name, token, backend, op=op, scatter_axis=scatter_axis)


def all_reduce_start(x, axis_name, token: Token, *, op: str = "sum", backend: str | None = None):
    """Begin an `all_reduce` (of one array, or a group: a tuple of arrays); returns `(handle, token)`.
    Finish it with `wait`."""
    return _start("all_reduce", x, axis_name, token, backend, op=op)


def sendrecv_start(x, axis_name, token: Token, *, perm: Sequence[tuple[int, int]], backend: str | None = None):
    """Begin a `sendrecv`; returns `(handle, token)`. Finish it with `wait`."""
    return _start("sendrecv", x, axis_name, token, backend, perm=perm)


def tie(values, token: Token):
    """Put `values` (a pytree of arrays) on the token's chain; returns `(values, token)`.

    The returned values are not available before everything earlier on the
    chain, and the returned token not before the values: use it to order your
    own compute against communication.
    """
    checks.check_token(token, "tie")
    leaves, treedef = jax.tree.flatten(values)
    leaves, token = _sequenced(tuple(leaves), token)
    return treedef.unflatten(list(leaves)), token


def wait(handle: Handle, token: Token):
    """Finish the async op behind `handle`; returns `(result, token)` (a tuple of results for a group).

    The token must be of the chain the op was started on, each handle is
    waited once, and only inside the `shard_map` that started it: a handle
    returned from `shard_map` is refused here, outside it or in another one.
    """
    checks.check_token(token, "wait")
    checks.check_handle(handle, token)
    get_backend(handle._backend).check_handle(handle)
    handle._waited = True
    params = dict(handle._params)
    axis_name = params.pop("axis_name")
    buffers, token = _sequenced(handle._buffers, token)
    be = get_backend(handle._backend)
    if "group" in params:
        group = [dict(p) for p in params["group"]]
        return _sequenced(tuple(be.finish_group(handle.op, buffers, axis_name, group)), token)
    result = be.finish(handle.op, buffers, axis_name, params)
    return _sequenced(result, token)
