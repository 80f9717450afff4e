"""Where the blocks live over `pp`: every block parameter is also split over pp (each rank stores
1/pp of every block, and of its optimizer state), and a step brings a stage's pieces to the stage's
rank (an all-to-all over pp, as pp - 1 ring-shifted sendrecvs) and its gradients back.

`pp_spec` is the layout rule the pipeline gives the engine's `Layout`; `StagePlacement` moves a
rank's chunks of blocks in and their gradients out.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxdist import comm
from jaxdist.engine.layout import Leaf, storage_spec
from jaxdist.engine.options import Options
from jaxdist.engine.unit_comm import by_dtype


def pp_dim(cfg: Options, blocks: str, leaf: Leaf) -> int | None:
    """The dimension of a block leaf's tp piece split over pp (each rank stores 1/pp of every
    block; the stage's owner collects them): the largest that divides, another than the storage
    dimension if one does; None (replicated over pp) for a leaf of the embedding or head, or
    when nothing divides."""
    if leaf.path[0] != blocks:
        return None
    pp = cfg.pp
    n_store = cfg.size(cfg.storage_axis) if cfg.storage_axis else 1
    fits = [d for d in range(len(leaf.local)) if d != leaf.store_dim and leaf.local[d] % pp == 0]
    if fits:
        return max(fits, key=lambda d: (leaf.local[d], -d))
    if leaf.store_dim is not None and leaf.local[leaf.store_dim] % (pp * n_store) == 0:
        return leaf.store_dim
    return None


def pp_spec(cfg: Options, blocks: str, leaf: Leaf) -> P:
    """The engine's placement (`storage_spec`), plus pp on `pp_dim` (inside tp, outside the storage
    axis, so a gather over the storage axis gives this rank's contiguous pp piece)."""
    dims = list(storage_spec(cfg, leaf))
    dims += [None] * (len(leaf.shape) - len(dims))
    d = pp_dim(cfg, blocks, leaf)
    if d is not None:
        axes = dims[d] if isinstance(dims[d], tuple) else (() if dims[d] is None else (dims[d],))
        tp = tuple(a for a in axes if a == cfg.tp_axis)
        dims[d] = (*tp, cfg.pp_axis, *(a for a in axes if a != cfg.tp_axis))
        dims[d] = dims[d][0] if len(dims[d]) == 1 else dims[d]
    return P(*dims)


class StagePlacement:
    """A rank's chunks of blocks: stage s holds blocks s * per_stage .. (s + 1) * per_stage - 1, and
    rank r runs stages r, r + pp, ... (chunk c is stage c * pp + r).

    Args:
      cfg: the pipeline's options (`pp`, `virtual`).
      leaves: every parameter's leaf; block_leaves: per block, its leaves.
      blocks: the blocks' attribute name; per_stage: blocks per stage.

    Attributes:
      stage_leaves: the leaves of blocks 0 .. per_stage - 1, which stand for every stage's (the template).
      pp_dims: per template leaf, its dimension split over pp (`pp_dim`).
    """

    def __init__(self, cfg: Options, leaves: list[Leaf], block_leaves: list[list[int]], blocks: str, per_stage: int):
        self.cfg, self.block_leaves, self.per_stage = cfg, block_leaves, per_stage
        self.stage_leaves = [k for b in range(per_stage) for k in block_leaves[b]]
        self.position = {k: (b, p) for b in range(per_stage) for p, k in enumerate(block_leaves[b])}
        self.pp_dims = {k: pp_dim(cfg, blocks, leaves[k]) for k in self.stage_leaves}

    def block_leaf(self, k: int, c: int, r: int) -> int:
        """The leaf that template leaf `k` (of blocks 0 .. per_stage - 1) is in chunk `c` of pp rank `r`."""
        b, p = self.position[k]
        return self.block_leaves[(c * self.cfg.pp + r) * self.per_stage + b][p]

    def shift(self, parts: list, s: int, tok):
        """Every pp rank sends `parts` to the rank `s` after it and gets the parts of the rank `s`
        before it: one sendrecv per dtype."""
        pp = self.cfg.pp
        perm = [(q, (q + s) % pp) for q in range(pp)]
        out = [None] * len(parts)
        for idx in by_dtype(list(range(len(parts))), dict(enumerate(parts))):
            flat = jnp.concatenate([parts[i].reshape(-1) for i in idx])
            got, tok = comm.sendrecv(flat, self.cfg.pp_axis, tok, perm=perm, backend=self.cfg.backend)
            offset = 0
            for i in idx:
                out[i] = got[offset : offset + parts[i].size].reshape(parts[i].shape)
                offset += parts[i].size
        return out, tok

    def stage_weights(self, w: dict, rank, tok):
        """Per template leaf, this rank's chunks' whole tp pieces `(v, ...)`: a block split over pp is
        put together from every rank's piece (pp - 1 shifted sendrecvs: an all-to-all), a block
        replicated over pp is picked."""
        pp, v = self.cfg.pp, self.cfg.virtual
        keys = [(k, c) for k in self.stage_leaves if self.pp_dims[k] is not None for c in range(v)]
        mine = {key: jnp.stack([w[self.block_leaf(*key, r)] for r in range(pp)]) for key in keys}
        got = {key: [mine[key][rank]] for key in keys}  # shift 0: this rank's own piece
        for s in range(1, pp):
            parts = [lax.dynamic_index_in_dim(mine[key], (rank + s) % pp, keepdims=False) for key in keys]
            parts, tok = self.shift(parts, s, tok)
            for key, x in zip(keys, parts, strict=True):
                got[key].append(x)  # piece (rank - s) of this rank's block

        def whole(k, c):
            if self.pp_dims[k] is None:
                return jnp.stack([w[self.block_leaf(k, c, r)] for r in range(pp)])[rank]
            by_shift = jnp.stack(got[(k, c)])
            pieces = [by_shift[(rank - j) % pp] for j in range(pp)]
            return jnp.concatenate(pieces, axis=self.pp_dims[k])

        return {k: jnp.stack([whole(k, c) for c in range(v)]) for k in self.stage_leaves}, tok

    def stage_grads(self, dw: dict, rank, tok):
        """Each block's gradient (on its stage's rank) as the pieces the blocks are stored in: a
        block split over pp sends piece j to rank j (the reverse all-to-all), a block replicated over
        pp is all-gathered."""
        pp, v = self.cfg.pp, self.cfg.virtual
        grads = {}
        keys = [(k, c) for k in self.stage_leaves if self.pp_dims[k] is not None for c in range(v)]
        pieces = {(k, c): jnp.stack(jnp.split(dw[k][c], pp, axis=self.pp_dims[k])) for k, c in keys}
        got = {key: [pieces[key][rank]] for key in keys}
        for s in range(1, pp):
            parts = [lax.dynamic_index_in_dim(pieces[key], (rank + s) % pp, keepdims=False) for key in keys]
            parts, tok = self.shift(parts, s, tok)
            for key, x in zip(keys, parts, strict=True):
                got[key].append(x)  # this rank's piece of the block of rank (rank - s)
        for k, c in keys:
            by_shift = jnp.stack(got[(k, c)])
            for r in range(pp):
                grads[self.block_leaf(k, c, r)] = by_shift[(rank - r) % pp]
        for k in self.stage_leaves:
            if self.pp_dims[k] is None:
                every, tok = comm.all_gather(dw[k], self.cfg.pp_axis, tok, tiled=False, backend=self.cfg.backend)
                for r in range(pp):
                    for c in range(v):
                        grads[self.block_leaf(k, c, r)] = every[r, c]
        return grads, tok
