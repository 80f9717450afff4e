"""The `xla` backend: jaxdist.comm ops as jax.lax collectives (every platform).

XLA schedules these itself; on GPU its async collective passes overlap them
with compute between the start and the wait that the token chain allows.
"""

from __future__ import annotations

import jax
from jax import lax

from jaxdist.comm._backend import Backend, floating_and_int_dtypes, scale_mean
from jaxdist.comm._checks import as_axis_names
from jaxdist.comm._ranks import reorder_rank


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
        names, perm = _in_mesh_order(axis_name, perm)
        return lax.ppermute(x, names, perm)


def _in_mesh_order(axis_name, perm):
    """`lax.ppermute` numbers a tuple of axes in mesh order, every other op in tuple order
    (see _ranks): give it the axes in mesh order and the pairs renumbered to match."""
    names = as_axis_names(axis_name)
    mesh_names = jax.sharding.get_abstract_mesh().axis_names
    if len(names) == 1 or not all(n in mesh_names for n in names):
        return axis_name, perm
    in_mesh_order = tuple(sorted(names, key=mesh_names.index))
    if in_mesh_order == names:
        return axis_name, perm
    sizes = {n: lax.axis_size(n) for n in names}

    def renumber(r):
        return reorder_rank(r, names, sizes, in_mesh_order)

    return in_mesh_order, tuple((renumber(s), renumber(d)) for s, d in perm)


XLA_BACKEND = XlaBackend()
