"""Input checks shared by every backend; each raises before compilation."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax import lax

from jaxdist.comm._types import Handle, Token
from jaxdist.compat import manual_axes

AxisName = str | tuple[str, ...]


def as_axis_names(axis_name: AxisName) -> tuple[str, ...]:
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(f"axis_name must be a mesh axis name or a tuple of them, got {axis_name!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"axis_name {axis_name!r} names an axis twice")
    return names


def axis_size(axis_name: AxisName) -> int:
    """Number of ranks along `axis_name`; a clear error for an unknown name."""
    size = 1
    for name in as_axis_names(axis_name):
        try:
            size *= lax.axis_size(name)
        except NameError:
            in_scope = manual_axes()
            where = f"the axes in scope here are {in_scope}" if in_scope else "no mesh axis is in scope"
            raise ValueError(
                f"unknown mesh axis {name!r}: {where}. Call jaxdist.comm ops inside "
                "jax.shard_map over a mesh that has this axis."
            ) from None
    return size


def check_token(tok: object, op: str) -> Token:
    if not isinstance(tok, Token):
        raise TypeError(
            f"{op}: expected an ordering token from jaxdist.comm.token() (or one an op returned), "
            f"got {type(tok).__name__}"
        )
    return tok


def check_array(x: object, op: str) -> jax.Array:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{op}: expected an array, got {type(x).__name__}")
    return x


def check_dim(dim: int, ndim: int, op: str, what: str) -> int:
    if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool):
        raise TypeError(f"{op}: {what} must be an int, got {dim!r}")
    if not -ndim <= dim < ndim:
        raise ValueError(f"{op}: {what}={dim} is out of range for an array of rank {ndim}")
    return int(dim) % ndim


def check_divisible(shape: tuple[int, ...], dim: int, parts: int, op: str, axis_name: AxisName) -> None:
    if shape[dim] % parts:
        raise ValueError(
            f"{op}: dimension {dim} of shape {tuple(shape)} has size {shape[dim]}, which does not "
            f"divide evenly over the {parts} ranks of axis {axis_name!r}; pad it to a multiple of {parts}"
        )


def check_reduce_op(reduce_op: object, allowed: Sequence[str], op: str) -> str:
    if not isinstance(reduce_op, str) or reduce_op not in allowed:
        raise ValueError(f"{op}: op={reduce_op!r} is not supported; choose one of {tuple(allowed)}")
    return reduce_op


def check_dtype(dtype: np.dtype, reduce_op: str | None, supported: Sequence[np.dtype], backend: str, op: str) -> None:
    dtype = np.dtype(dtype)
    if dtype not in [np.dtype(d) for d in supported]:
        names = ", ".join(np.dtype(d).name for d in supported)
        raise TypeError(f"{op}: dtype {dtype.name} is not supported by the {backend!r} backend; use one of {names}")
    if reduce_op == "mean" and not np.issubdtype(dtype, np.floating) and dtype.name != "bfloat16":
        raise TypeError(
            f"{op}: op='mean' needs a floating dtype, got {dtype.name}; reduce with op='sum' and divide yourself"
        )


def _is_rank(value: object) -> bool:
    # numpy integers are ranks too; a bool, a float (even 1.0) or a string is a mistake
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_perm(perm: Sequence[tuple[int, int]], size: int, axis_name: AxisName) -> tuple[tuple[int, int], ...]:
    try:
        pairs = tuple((s, d) for s, d in perm)
    except (TypeError, ValueError):
        raise TypeError(f"sendrecv: perm must be a sequence of (src, dst) rank pairs, got {perm!r}") from None
    for pair in pairs:
        if not all(_is_rank(r) for r in pair):
            raise TypeError(
                f"sendrecv: perm pair {pair!r} holds a non-integer rank; ranks are ints (Python or numpy), "
                "not bools, floats or strings"
            )
    pairs = tuple((int(s), int(d)) for s, d in pairs)
    sources = [s for s, _ in pairs]
    dests = [d for _, d in pairs]
    for rank in sources + dests:
        if not 0 <= rank < size:
            raise ValueError(f"sendrecv: rank {rank} in perm is out of range for axis {axis_name!r} of size {size}")
    for kind, ranks in (("source", sources), ("destination", dests)):
        dup = sorted({r for r in ranks if ranks.count(r) > 1})
        if dup:
            raise ValueError(
                f"sendrecv: perm has duplicate {kind} rank(s) {dup}; each rank may send once and receive once"
            )
    return pairs


def check_handle(handle: object, tok: Token) -> Handle:
    if not isinstance(handle, Handle):
        raise TypeError(f"wait: expected a Handle from a *_start op, got {type(handle).__name__}")
    if handle.left_its_shard_map():
        raise ValueError(
            f"wait: this {handle.op} handle is waited outside the shard_map it was started in (it was returned "
            "from that shard_map, perhaps into another one). A handle may only be waited inside the shard_map "
            "that started it: call wait there and return the result instead"
        )
    if handle._waited:
        raise ValueError(f"wait: this {handle.op} handle was already waited; each handle is waited exactly once")
    if handle.chain != tok.chain:
        raise ValueError(
            f"wait: the {handle.op} handle was started on token chain {handle.chain!r} but is waited with a "
            f"token of chain {tok.chain!r}; wait with the chain the op was started on"
        )
    return handle
