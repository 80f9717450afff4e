"""A unit's communication over the data axes as two async ops: the gather of its pieces over the
storage axis, and the reduction of its gradients (a reduce-scatter over the storage axis, an
all-reduce over the other data axes).

Each op packs the unit's pieces into one buffer per dtype, or (`pack_units=False`) communicates them
as grouped collectives over the pieces themselves, with no flat buffers. A handle holds arrays only; the wait
recomputes the buffers' keys from the values its handle carries, so the gathered weights exist
only as the value the wait returns (no read before publication: docs/design.md).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxdist import comm
from jaxdist.engine.layout import Layout
from jaxdist.engine.options import Options, axis_arg
from jaxdist.engine.prefetch import AsyncOp


def by_dtype(keys: list, arrays: dict) -> list[list]:
    """`keys` (in their order) grouped by the dtype of `arrays[k]`, one group per dtype: each group is one
    communication buffer, since a buffer concatenated from mixed dtypes would promote them all (a bfloat16
    weight gathered, and computed with, as float32)."""
    groups: dict = {}
    for k in keys:
        groups.setdefault(jnp.dtype(arrays[k].dtype), []).append(k)
    return [groups[d] for d in sorted(groups, key=str)]


def fetch(op: AsyncOp, value, tok):
    """`op` started and waited at once."""
    h, tok = op.start(value, tok)
    return op.wait(h, tok)


def in_compute_dtype(cfg: Options, ws: dict) -> dict:
    """The floating pieces of `ws` cast to `cfg.compute_dtype` (unchanged without one)."""
    dtype = cfg.compute_dtype
    if dtype is None:
        return ws

    def cast(w):
        return w.astype(dtype) if jnp.issubdtype(w.dtype, jnp.floating) else w

    return {k: cast(w) for k, w in ws.items()}


class UnitComm:
    """The gather and reduce ops of units laid out by `layout` (`gather`, `reduce`: `AsyncOp`s on
    `{leaf index: piece}` dicts)."""

    def __init__(self, cfg: Options, layout: Layout):
        self.cfg, self.layout = cfg, layout
        self.axis = cfg.storage_axis
        self.others = tuple(a for a in cfg.data_axes if a != self.axis)
        # what a piece kept whole over the storage axis is reduced over
        self.over = (self.axis, *self.others) if self.axis else self.others
        self.gather = AsyncOp(self.gather_start, self.gather_wait, "engine.gather")
        self.reduce = AsyncOp(self.reduce_start, self.reduce_wait, "engine.reduce")

    def buffers(self, arrays: dict, sharded: bool) -> list[list]:
        """The keys of the pieces sharded over the storage axis (or of those kept whole, when there is
        something to reduce them over), one group per dtype: each group is one communication buffer."""
        if not sharded and not self.over:
            return []
        keys = [k for k in sorted(arrays) if (self.layout.store_dim(k, arrays[k]) is not None) == sharded]
        return by_dtype(keys, arrays)

    def gather_start(self, ws: dict, tok):
        # pieces tied first: a unit gathered again for backward packs its own copy, which XLA cannot
        # merge (CSE) with the forward's and keep alive from forward to backward
        ws, tok = comm.tie(ws, tok)
        ws = in_compute_dtype(self.cfg, ws)  # before the gather: the collective moves the compute dtype
        if not self.cfg.pack_units:
            ks = self.pieces(ws, sharded=True)
            if not ks:
                return ((), ws), tok
            dims = [self.layout.store_dim(k, ws[k]) for k in ks]
            h, tok = comm.all_gather_start(
                tuple(ws[k] for k in ks), self.axis, tok, axis=dims, backend=self.cfg.backend
            )
            return ((h,), ws), tok
        handles = []
        for ks in self.buffers(ws, sharded=True):
            flat = jnp.concatenate([ws[k].reshape(-1) for k in ks])
            h, tok = comm.all_gather_start(flat, self.axis, tok, tiled=False, backend=self.cfg.backend)
            handles.append(h)
        return (handles, ws), tok

    def gather_wait(self, handle, tok):
        handles, ws = handle
        out = dict(ws)
        if not self.cfg.pack_units:
            for h in handles:  # one group: each piece gathered whole along its storage dimension
                gathered, tok = comm.wait(h, tok)
                out.update(zip(self.pieces(ws, sharded=True), gathered, strict=True))
            return out, tok
        for ks, h in zip(self.buffers(ws, sharded=True), handles, strict=True):
            stacked, tok = comm.wait(h, tok)  # (n, S): every storage rank's pieces
            offset = 0
            for k in ks:
                size = ws[k].size
                part = stacked[:, offset : offset + size].reshape(stacked.shape[0], *ws[k].shape)
                dim = self.layout.store_dim(k, ws[k])
                out[k] = jnp.concatenate(list(part), axis=dim) if len(part) > 1 else part[0]
                offset += size
        return out, tok

    def reduce_start(self, gs: dict, tok):
        cfg, axis = self.cfg, self.axis
        if cfg.reduce_dtype is not None:
            gs = {k: g.astype(cfg.reduce_dtype) for k, g in gs.items()}
        if not cfg.pack_units:
            return self._reduce_start_grouped(gs, tok)
        n = cfg.size(axis) if axis else 1
        scattered, reduced = [], []
        for ks in self.buffers(gs, sharded=True):
            chunks = []
            for k in ks:
                g, d = gs[k], self.layout.store_dim(k, gs[k])
                g = g.reshape(*g.shape[:d], n, g.shape[d] // n, *g.shape[d + 1 :])
                chunks.append(jnp.moveaxis(g, d, 0).reshape(n, -1))
            packed = jnp.concatenate(chunks, axis=1)
            h, tok = comm.reduce_scatter_start(packed, axis, tok, op="mean", backend=cfg.backend)
            scattered.append(h)
        for ks in self.buffers(gs, sharded=False):
            flat = jnp.concatenate([gs[k].reshape(-1) for k in ks])
            h, tok = comm.all_reduce_start(flat, axis_arg(self.over), tok, op="mean", backend=cfg.backend)
            reduced.append(h)
        return (scattered, reduced, gs), tok

    def reduce_wait(self, handle, tok):
        cfg = self.cfg
        scattered, reduced, gs = handle
        if not cfg.pack_units:
            return self._reduce_wait_grouped(scattered, reduced, gs, tok)
        out = dict(gs)
        for ks, h in zip(self.buffers(gs, sharded=True), scattered, strict=True):
            flat, tok = comm.wait(h, tok)
            flat = flat.reshape(-1)
            if self.others:
                flat, tok = comm.all_reduce(flat, axis_arg(self.others), tok, op="mean", backend=cfg.backend)
            offset = 0
            for k in ks:
                shape = list(gs[k].shape)
                shape[self.layout.store_dim(k, gs[k])] //= cfg.size(self.axis)
                size = int(np.prod(shape))
                out[k] = flat[offset : offset + size].reshape(shape)
                offset += size
        for ks, h in zip(self.buffers(gs, sharded=False), reduced, strict=True):
            flat, tok = comm.wait(h, tok)
            offset = 0
            for k in ks:
                out[k] = flat[offset : offset + gs[k].size].reshape(gs[k].shape)
                offset += gs[k].size
        return out, tok

    def pieces(self, arrays: dict, sharded: bool) -> list:
        """The keys `buffers` holds, as one list (a group carries pieces of any dtype side by side)."""
        return [k for ks in self.buffers(arrays, sharded) for k in ks]

    def _reduce_start_grouped(self, gs: dict, tok):
        """`reduce_start` with `pack_units=False`: one reduce-scatter group over the sharded pieces (each
        scattered along its storage dimension), one all-reduce group over the whole ones."""
        cfg = self.cfg
        scattered = reduced = ()
        ks = self.pieces(gs, sharded=True)
        if ks:
            dims = [self.layout.store_dim(k, gs[k]) for k in ks]
            h, tok = comm.reduce_scatter_start(
                tuple(gs[k] for k in ks), self.axis, tok, op="mean", scatter_axis=dims, backend=cfg.backend
            )
            scattered = (h,)
        ks = self.pieces(gs, sharded=False)
        if ks:
            h, tok = comm.all_reduce_start(
                tuple(gs[k] for k in ks), axis_arg(self.over), tok, op="mean", backend=cfg.backend
            )
            reduced = (h,)
        return (scattered, reduced, gs), tok

    def _reduce_wait_grouped(self, scattered, reduced, gs: dict, tok):
        cfg = self.cfg
        out = dict(gs)
        for h in scattered:
            shards, tok = comm.wait(h, tok)
            if self.others:  # the shards averaged over the other data axes too, as one group
                shards, tok = comm.all_reduce(shards, axis_arg(self.others), tok, op="mean", backend=cfg.backend)
            out.update(zip(self.pieces(gs, sharded=True), shards, strict=True))
        for h in reduced:
            whole, tok = comm.wait(h, tok)
            out.update(zip(self.pieces(gs, sharded=False), whole, strict=True))
        return out, tok
