"""Collectives with explicit ordering tokens, for use inside `jax.shard_map`.

Every op takes a token and returns `(result, new_token)`; ops threaded through
one token chain run in chain order. Async forms (`*_start`) return a handle
that only `wait` turns into a value. Two backends share one signature:
`"xla"` (jax.lax collectives, the default) and `"nccl"` (XLA FFI ops on GPU).

Ranks along a tuple of axes, `axis_name=("b", "a")`, are numbered in tuple
order (`b` most significant), as `lax.axis_index` numbers them, by every op and
both backends, whatever the mesh's axis order (see `_ranks`).
"""

from jaxdist.comm import xla
from jaxdist.comm._backend import (
    Backend,
    default_backend,
    get_backend,
    op_site,
    register_backend,
    set_default_backend,
)
from jaxdist.comm._ops import (
    all_gather,
    all_gather_start,
    all_reduce,
    all_reduce_start,
    reduce_scatter,
    reduce_scatter_start,
    sendrecv,
    sendrecv_start,
    tie,
    wait,
)
from jaxdist.comm._types import Handle, Token, token


def _xla_backend() -> Backend:
    return xla.XLA_BACKEND


def _nccl_backend() -> Backend:
    # imported on first use: loading the nccl module needs nothing, but it is the GPU-only half
    from jaxdist.comm.nccl import nccl_backend

    return nccl_backend()


register_backend("xla", _xla_backend)
register_backend("nccl", _nccl_backend)

__all__ = [
    "Backend",
    "Handle",
    "Token",
    "all_gather",
    "all_gather_start",
    "all_reduce",
    "all_reduce_start",
    "default_backend",
    "get_backend",
    "op_site",
    "reduce_scatter",
    "reduce_scatter_start",
    "sendrecv",
    "sendrecv_start",
    "set_default_backend",
    "tie",
    "token",
    "wait",
]
