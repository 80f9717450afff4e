"""The `xla` backend: jaxdist.comm ops as jax.lax collectives (every platform).

XLA schedules these itself; on GPU its async collective passes overlap them
with compute between the start and the wait that the token chain allows.
"""

from __future__ import annotations

from jax import lax

from jaxdist.comm._backend import Backend, floating_and_int_dtypes, scale_mean


class XlaBackend(Backend):
    name = "xla"
    dtypes = floating_and_int_dtypes()

    def all_gather(self, x, axis_name, *, axis, tiled, size):
        return lax.all_gather(x, axis_name, axis=axis, tiled=tiled)

    def reduce_scatter(self, x, axis_name, *, op, scatter_axis, size):
        total = lax.psum_scatter(x, axis_name, scatter_dimension=scatter_axis, tiled=True)
        return scale_mean(total, size) if op == "mean" else total

    def all_reduce(self, x, axis_name, *, op, size):
        if op == "max":
            return lax.pmax(x, axis_name)
        if op == "min":
            return lax.pmin(x, axis_name)
        total = lax.psum(x, axis_name)
        return scale_mean(total, size) if op == "mean" else total

    def sendrecv(self, x, axis_name, *, perm, size):
        return lax.ppermute(x, axis_name, perm)


XLA_BACKEND = XlaBackend()
