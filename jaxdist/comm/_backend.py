"""The backend interface and the process-wide default backend.

A backend turns one validated collective into array ops. Both backends take
the same arguments and give the same results; the public functions in
`jaxdist.comm` do the checking and the token sequencing once for both.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.comm._sequence import sequence

BACKEND_ENV = "JAXDIST_COMM_BACKEND"
BACKEND_NAMES = ("xla", "nccl")


class Backend:
    """Base class: the four collectives, and how an async pair (of one op or a group) is split."""

    name: str = ""
    dtypes: tuple[Any, ...] = ()

    def all_gather(self, x, axis_name, *, axis: int, tiled: bool, size: int): ...
    def reduce_scatter(self, x, axis_name, *, op: str, scatter_axis: int, size: int): ...
    def all_reduce(self, x, axis_name, *, op: str, size: int): ...
    def sendrecv(self, x, axis_name, *, perm: tuple, size: int): ...

    def start(self, kind: str, x, axis_name, params: dict) -> tuple:
        """Begin `kind`; return the buffers that must stay alive until `finish`."""
        return (getattr(self, kind)(x, axis_name, **params),)

    def finish(self, kind: str, buffers: tuple, axis_name, params: dict):
        """End the op begun by `start`; return its result."""
        return buffers[0]

    def start_group(self, kind: str, xs: tuple, axis_name, params: list[dict]) -> tuple:
        """Begin `kind` over every array of `xs` (params[i] is array i's); return the buffers that
        must stay alive until `finish_group`. Here: one op per array, started together."""
        return tuple(getattr(self, kind)(x, axis_name, **p) for x, p in zip(xs, params, strict=True))

    def finish_group(self, kind: str, buffers: tuple, axis_name, params: list[dict]) -> tuple:
        """End the group begun by `start_group`; return its results, one per array."""
        return tuple(buffers)

    # Whether a handle of this backend may be carried across a scan/while boundary before its wait.
    handles_cross_loops = True

    def check_handle(self, handle) -> None:
        """Raise if `handle` cannot be waited here (see NcclBackend)."""

    def issued(self, buffers: tuple, token):
        """Tie the token after a start to the op's issue, where the backend can express it.

        Here (the xla backend): on CPU, where collectives are synchronous, the
        token follows the collective; on GPU/TPU it does not, since tying it
        would also force completion and XLA's async collective passes pick the
        issue point themselves.
        """
        return sequence(buffers, token, cpu_only=True)


def floating_and_int_dtypes() -> tuple[Any, ...]:
    return (
        jnp.float32,
        jnp.bfloat16,
        jnp.float16,
        jnp.float64,
        jnp.int8,
        jnp.uint8,
        jnp.int32,
        jnp.uint32,
        jnp.int64,
        jnp.uint64,
    )


def scale_mean(total: jax.Array, size: int) -> jax.Array:
    """Divide a sum by the rank count in its own dtype (mean for floats only)."""
    return (total / np.asarray(size, dtype=total.dtype)).astype(total.dtype)


_default: str | None = None
_site: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxdist_comm_site", default=None)


@contextlib.contextmanager
def op_site(name: str):
    """Name the async ops started inside as one call site.

    A loop that is partly unrolled and partly a `scan` starts the "same" op
    from several traced places; naming the site keeps their handles of one
    type, so a handle started before a scan can be waited inside it. (With
    the nccl backend, ops of one site share a completion event; the side
    stream runs them in order, so a wait is never early, only at worst later.)
    """
    token = _site.set(name)
    try:
        yield
    finally:
        _site.reset(token)


def current_site() -> str | None:
    return _site.get()


def set_default_backend(name: str) -> None:
    """Set the backend used by every comm op that is not given `backend=`."""
    global _default
    _check_name(name)
    _default = name


def default_backend() -> str:
    """The process-wide default: set_default_backend(), else $JAXDIST_COMM_BACKEND, else 'xla'."""
    name = _default or os.environ.get(BACKEND_ENV, "xla")
    return _check_name(name)


def _check_name(name: str) -> str:
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown comm backend {name!r}; choose one of {BACKEND_NAMES}")
    return name


# name -> a function returning that backend; filled in by `jaxdist.comm`, which knows the backends,
# so this module (which every backend imports) imports none of them
_FACTORIES: dict[str, Callable[[], Backend]] = {}


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    """Make `get_backend(name)` return `factory()` (called on each use; the factory caches)."""
    _check_name(name)
    _FACTORIES[name] = factory


def get_backend(name: str | None) -> Backend:
    name = _check_name(name) if name is not None else default_backend()
    return _FACTORIES[name]()
