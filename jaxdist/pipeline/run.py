"""Pipeline parallelism over a `pp` mesh axis: the unit engine's blocks split into stages, run by
a schedule table (`jaxdist.pipeline.schedule`), composed with the engine's data and tp axes.

The repeated blocks split into `pp * v` stages of equal length; rank r of `pp`
runs stages r, r + pp, ... (its chunks), the embedding runs with stage 0 and
the head and loss with the last stage. Each data rank's batch splits into
micro-batches. The step runs the schedule's ticks in order, inside the
engine's `shard_map`: at a tick every rank runs its table entry (a `lax.switch`
on its pp rank), then the tick's activations and gradients move between
neighbouring stages in one `comm.sendrecv` (with the nccl backend: one NCCL
group, also for a warm-up tick's lone send and a cool-down tick's lone
receive), on one token chain that orders the ticks.

Memory: a stage keeps only the inputs it received, in slots the table assigns
(freed by the backward that reads them), and its backward recomputes the
stage's forward from that input; so the live activations of 1F1B are bounded
by pp, not by the micro-batch count. The last stage's forward runs inside its
backward (one recompute fewer).

Parameters are the model's tree, stored as the engine stores them (over the
data axes and split over tp), and every block parameter is also split over pp:
each rank stores 1/pp of every block (and of its optimizer state). A step
brings a stage's pieces to the stage's rank (an all-to-all over pp, as pp - 1
ring-shifted sendrecvs) and its gradients back to the pieces. The embedding
and head are replicated over pp; their gradients are summed over pp.

A rank's stage gradients are averaged over the data axes in the tick of its
last op (one all-reduce per dtype, inside the tick loop), so the last stage's
reduction runs while the earlier stages still run the cool-down; each rank
then keeps its storage share. Everything else is the engine's
(`jaxdist.engine.ParallelRun`): the block code runs with the plan's parallel
layers bound, and the optimizer, global norm, clipping and skip run on the
parameter tree outside the per-device program.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxdist import comm
from jaxdist.core.compat import model_sharding_dropped
from jaxdist.engine.run import Parallel, ParallelRun, Units, by_dtype
from jaxdist.pipeline import schedule as ps

IDLE, F_FIRST, F_MID, F_LAST, B_FIRST, B_MID, B_LAST = range(7)


@dataclasses.dataclass(frozen=True)
class Pipelined(Parallel):
    """`Parallel`'s options plus a pipeline axis.

    Attributes:
      pp_axis: the mesh axis the stages are spread over (size >= 2).
      microbatches: micro-batches per data rank's batch (its rows must divide).
      schedule: "1f1b", "gpipe" or "interleaved" (`jaxdist.pipeline.schedule`).
      virtual: stages per rank (chunks) of the interleaved schedule.

    A stage's backward always recomputes its forward from the stage input (so `remat=True` adds
    nothing and `remat=False`, keeping activations, is refused), and with an fsdp axis a step
    gathers this rank's pieces once and keeps them (`reshard_after_forward`, `buffers` and
    `prefetch` do not apply).
    """

    pp_axis: str = "pp"
    microbatches: int = 4
    schedule: str = "1f1b"
    virtual: int = 1

    def __post_init__(self):
        super().__post_init__()
        if self.pp < 2:
            raise ValueError(f"Pipelined: the mesh needs a {self.pp_axis!r} axis of size >= 2; use Parallel without")
        for flag in ("record_weights", "sequence_parallel", "update_in_backward"):
            if getattr(self, flag):
                raise ValueError(f"Pipelined: {flag} is not supported with a pipeline axis yet; turn it off")
        if self.remat is False:
            raise ValueError(
                "Pipelined: a stage's backward always recomputes its forward from the stage input, so it cannot "
                "keep activations (remat=False); leave remat unset (None)"
            )
        self.table()  # a table that cannot run is an error now, before anything is traced

    def _axis_roles(self) -> dict[str, str]:
        return {**super()._axis_roles(), "pp_axis": self.pp_axis}

    @property
    def pp(self) -> int:
        return self._size(self.pp_axis)

    def table(self) -> ps.Schedule:
        """The validated schedule table the step runs."""
        return ps.make(self.schedule, self.pp, self.microbatches, self.virtual)

    def prepare(self, model, optimizer, units: Units, batch) -> PipelineRun:
        """Shard `model`'s parameters and build the pipelined train step (as `Parallel.prepare`)."""
        return PipelineRun(self, model, optimizer, units, batch)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Per tick, per pp rank: the branch, chunk, micro-batch, input slots, and what arrives where."""

    branch: np.ndarray  # (ticks, pp)
    chunk: np.ndarray
    microbatch: np.ndarray
    act_slot: np.ndarray
    grad_slot: np.ndarray
    recv_kind: np.ndarray  # 0 nothing, 1 activation, 2 gradient
    recv_slot: np.ndarray
    done: np.ndarray  # 1 at the tick of the rank's last op: its stage gradients are final
    act_slots: int
    grad_slots: int


def _plan(s: ps.Schedule) -> _Plan:
    """The table as the arrays the step indexes by pp rank. A received message takes the lowest free
    slot of its kind on its rank; the backward of its (stage, micro-batch) frees it."""
    shape = (len(s.ticks), s.pp)
    arrays = {k: np.zeros(shape, np.int32) for k in _Plan.__dataclass_fields__ if k not in ("act_slots", "grad_slots")}
    most = {ps.ACTIVATION: 1, ps.GRADIENT: 1}
    last = s.stages - 1
    for r in range(s.pp):
        held: dict[tuple, int] = {}
        final_tick = 0
        for t, tick in enumerate(s.ticks):
            op = tick.ops[r]
            if op is not None:
                forward = op.kind == ps.FORWARD
                first, end = op.stage == 0, op.stage == last
                arrays["branch"][t, r] = (F_FIRST if first else F_LAST if end else F_MID) + (0 if forward else 3)
                arrays["chunk"][t, r] = op.stage // s.pp
                arrays["microbatch"][t, r] = op.microbatch
                act = (ps.ACTIVATION, op.microbatch, op.stage)
                grad = (ps.GRADIENT, op.microbatch, op.stage)
                arrays["act_slot"][t, r] = held.get(act, 0)
                arrays["grad_slot"][t, r] = held.get(grad, 0)
                if not forward:
                    held.pop(act, None)
                    held.pop(grad, None)
                final_tick = t
            msg = tick.recvs[r]
            if msg is not None:
                taken = {slot for key, slot in held.items() if key[0] == msg.kind}
                slot = min(set(range(len(taken) + 1)) - taken)
                held[(msg.kind, msg.microbatch, msg.stage)] = slot
                most[msg.kind] = max(most[msg.kind], slot + 1)
                arrays["recv_kind"][t, r] = 1 if msg.kind == ps.ACTIVATION else 2
                arrays["recv_slot"][t, r] = slot
        arrays["done"][final_tick, r] = 1
    return _Plan(**arrays, act_slots=most[ps.ACTIVATION], grad_slots=most[ps.GRADIENT])


class PipelineRun(ParallelRun):
    """A prepared pipelined run: `state`, `step`, `params`, `model` as `ParallelRun`'s; `table` is
    the schedule it runs (print it)."""

    def __init__(self, cfg: Pipelined, model, optimizer, units: Units, batch):
        for flag in ("stacked", "has_aux", "sum_and_count"):
            if getattr(units, flag):
                raise ValueError(f"Pipelined: Units({flag}=True) is not supported with a pipeline axis yet")
        self.table = cfg.table()
        self.plan = _plan(self.table)
        super().__init__(cfg, model, optimizer, units, batch)
        stages = cfg.pp * cfg.virtual
        if self.n_blocks % stages:
            raise ValueError(
                f"Pipelined: {self.n_blocks} blocks do not split into pp * virtual = {stages} stages of equal "
                "length; change pp, virtual or the number of blocks"
            )
        self.per_stage = self.n_blocks // stages
        # a stage's leaves: those of blocks 0 .. per_stage - 1 stand for every stage's (the template)
        self.stage_leaves = [k for b in range(self.per_stage) for k in self.block_leaves[b]]
        self.position = {k: (b, p) for b in range(self.per_stage) for p, k in enumerate(self.block_leaves[b])}
        self.pp_dims = {k: self._pp_dim(self.leaves[k]) for k in self.stage_leaves}
        shapes = lambda i: [(self.leaves[k].shape, self.leaves[k].dtype) for k in self.block_leaves[i]]
        for i in range(self.n_blocks):
            same = self.block_kinds[i] == self.block_kinds[0] and self.block_trees[i] == self.block_trees[0]
            if not (same and shapes(i) == shapes(0)):
                raise ValueError(
                    f"Pipelined: block {i} differs from block 0 (code, static attributes or parameter shapes); "
                    "every rank runs one stage program, so the blocks must be identical"
                )
        if not self.outer_state.empty or any(not ms.empty for ms in self.block_states):
            raise ValueError(
                "Pipelined: models with non-parameter variables (dropout RNG streams, batch statistics) are not "
                "supported with a pipeline axis yet"
            )

    def _check_batch(self, batch):
        local = super()._check_batch(batch)
        self._micro_avals(local)
        return local

    def _micro_avals(self, local):
        """One micro-batch's avals of a data rank's batch `local`; rows that do not split raise."""
        m = self.cfg.microbatches
        rows = jax.tree.leaves(local)[0].shape[0]
        if rows % m:
            raise ValueError(
                f"Pipelined: each data rank's {rows} rows do not split into microbatches={m}; change the batch "
                "size or the micro-batch count"
            )
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] // m, *a.shape[1:]), a.dtype), local)

    def _x_aval(self, micro):
        """The activations' aval between stages for micro-batches of avals `micro`."""
        start = self.initial_model_state["outer"]
        embed = lambda ws, b: self._outer_apply(ws, start, lambda mod: self.units.embed(mod, b), bound=False)[0]
        return jax.eval_shape(embed, self._avals(self.embed_leaves, whole=True), micro)

    # -- the per-device program ---------------------------------------------------------------

    @model_sharding_dropped()  # the per-device program: the model's own sharding annotations are no-ops
    def _local_grads(self, params, model_state, step, batch):
        cfg, s, plan = self.cfg, self.table, self.plan
        v, m = cfg.virtual, cfg.microbatches
        rank = lax.axis_index(cfg.pp_axis)
        gather, reduce = self._ops()
        tok = comm.token()
        handle, tok = gather.start(dict(enumerate(jax.tree.leaves(params))), tok)
        w, tok = gather.wait(handle, tok)  # every piece whole over the storage axis, kept for the step

        template = self.stage_leaves
        chunks, tok = self._stage_weights(w, rank, tok)  # leaf of the template blocks -> (v, *tp piece)
        embed_w = {k: w[k] for k in self.embed_leaves}
        head_w = {k: w[k] for k in self.head_leaves}
        outer_keys = sorted(set(self.embed_leaves) | set(self.head_leaves))
        micro = jax.tree.map(lambda a: a.reshape(m, a.shape[0] // m, *a.shape[1:]), batch)
        outer_in, blocks_in = model_state["outer"], model_state["blocks"]

        def blocks(cw, x, b):
            for i in range(self.per_stage):
                x, _ = self._block(i, {k: cw[k] for k in self.block_leaves[i]}, x, b, blocks_in[i])
            return x

        embed = lambda ew, b: self._embed(ew, b, outer_in)[0]
        head = lambda hw, x, b: self._head(hw, x, b, outer_in)[0]
        # this step's batch may differ in size from prepare's example: the activations' shape follows it
        x_aval = self._x_aval(self._micro_avals(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)))
        zeros_x = jnp.zeros(x_aval.shape, x_aval.dtype)
        seed = jnp.asarray(1.0 / m)  # the global batch mean is the mean of the micro-batch means

        def add(st, c, d_cw, d_ow=None, loss=None):
            st = dict(st)
            st["dw"] = {k: st["dw"][k].at[c].add(d_cw[k]) for k in template}
            if d_ow:
                st["douter"] = {k: st["douter"][k] + d_ow.get(k, 0) for k in outer_keys}
            if loss is not None:
                st["loss"] = st["loss"] + loss / m
            return st

        def branch(kind):
            def run(st, c, i, a, g):
                b = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False), micro)
                cw = {k: lax.dynamic_index_in_dim(chunks[k], c, keepdims=False) for k in template}
                x, dy = st["acts"][a], st["grads"][g]
                if kind == F_FIRST:
                    return st, blocks(cw, embed(embed_w, b), b)
                if kind == F_MID:
                    return st, blocks(cw, x, b)
                if kind == B_FIRST:
                    _, vjp = jax.vjp(lambda ew, cw: blocks(cw, embed(ew, b), b), embed_w, cw)
                    d_ew, d_cw = vjp(dy)
                    return add(st, c, d_cw, d_ew), zeros_x
                if kind == B_MID:
                    _, vjp = jax.vjp(lambda cw, x: blocks(cw, x, b), cw, x)
                    d_cw, dx = vjp(dy)
                    return add(st, c, d_cw), dx
                if kind == B_LAST:
                    loss, vjp = jax.vjp(lambda hw, cw, x: head(hw, blocks(cw, x, b), b), head_w, cw, x)
                    d_hw, d_cw, dx = vjp(seed.astype(loss.dtype))
                    return add(st, c, d_cw, d_hw, loss), dx
                return st, zeros_x  # idle, and the last stage's forward (run inside its backward)

            return run

        x_slots = lambda n: jnp.zeros((n, *x_aval.shape), x_aval.dtype)
        # micro-batch gradients summed in reduce_dtype where it is the wider (float32 for bfloat16 compute):
        # a bfloat16 sum would lose what reducing in float32 keeps
        summed = lambda dtype: jnp.promote_types(dtype, cfg.reduce_dtype or dtype)
        st = {
            "acts": x_slots(plan.act_slots),
            "grads": x_slots(plan.grad_slots),
            "dw": {k: jnp.zeros((v, *chunks[k].shape[1:]), summed(chunks[k].dtype)) for k in template},
            "douter": {k: jnp.zeros(w[k].shape, summed(w[k].dtype)) for k in outer_keys},
            "loss": jnp.zeros((), jnp.float32),
        }
        # one traced tick, scanned over the table's rows; a tick's communication is one of the table's
        # distinct sendrecv patterns (a switch uniform over pp, so every rank takes the same one)
        perms = sorted({t.perm() for t in s.ticks})
        pattern = np.asarray([perms.index(t.perm()) for t in s.ticks], np.int32)
        rows = (plan.branch, plan.chunk, plan.microbatch, plan.act_slot, plan.grad_slot, plan.recv_kind)
        branches = [branch(k) for k in range(B_LAST + 1)]

        def exchange(perm):
            def run(out, tok):
                if not perm:
                    return jnp.zeros_like(out), tok
                return comm.sendrecv(out, cfg.pp_axis, tok, perm=perm, backend=cfg.backend)

            return run

        def average_stages(st, tok):
            """The rank's stage gradients averaged over the data axes in reduce_dtype (one all-reduce per dtype)."""
            dw = {k: x.astype(cfg.reduce_dtype or x.dtype) for k, x in st["dw"].items()}
            dw, tok = _mean_over(dw, data_axes, tok, cfg.backend)
            return {**st, "dw": {k: x.astype(st["dw"][k].dtype) for k, x in dw.items()}}, tok

        def tick(carry, row):
            st, tok = carry
            (kind, c, i, a, g, got_kind), slot, which = [x[rank] for x in row[:6]], row[6][rank], row[7]
            st, out = lax.switch(kind, branches, st, c, i, a, g)
            got, tok = lax.switch(which, [exchange(p) for p in perms], out, tok)
            for code, name in ((1, "acts"), (2, "grads")):
                keep = lax.dynamic_index_in_dim(st[name], slot, keepdims=False)
                new = jnp.where(got_kind == code, got, keep)
                st = {**st, name: lax.dynamic_update_index_in_dim(st[name], new, slot, 0)}
            if data_axes:  # after the rank's last op, while the other stages still run the cool-down
                st, tok = lax.cond(row[8][rank] == 1, average_stages, lambda st, tok: (st, tok), st, tok)
            return (st, tok), None

        data_axes = cfg.data_axes[0] if len(cfg.data_axes) == 1 else cfg.data_axes
        xs = tuple(jnp.asarray(x) for x in (*rows, plan.recv_slot, pattern, plan.done))
        (st, tok), _ = lax.scan(tick, (st, tok), xs)

        # each block's gradient (already averaged over the data axes) back to the pp pieces it is
        # stored in, then this rank's share of the storage axis; embedding and head summed over pp
        # and reduced over the data axes as the engine reduces a unit's
        grads, tok = self._stage_grads(st["dw"], rank, tok)
        grads = {k: self._storage_share(k, g) for k, g in grads.items()}
        outer = {}
        for k in outer_keys:
            outer[k], tok = comm.all_reduce(st["douter"][k], cfg.pp_axis, tok, op="sum", backend=cfg.backend)
        handle, tok = reduce.start(outer, tok)
        outer, tok = reduce.wait(handle, tok)
        grads.update(outer)
        loss, tok = comm.all_reduce(st["loss"], cfg.pp_axis, tok, op="sum", backend=cfg.backend)
        if cfg.data_axes:
            loss, tok = comm.all_reduce(loss, data_axes, tok, op="mean", backend=cfg.backend)
        out = [grads[k].astype(self.leaves[k].dtype) for k in range(len(self.leaves))]
        return self.treedef.unflatten(out), model_state, {"loss": loss}

    def _storage_share(self, k: int, g):
        """This rank's slice of a gradient already averaged over the data axes, along the storage
        dimension (the slice a reduce-scatter over the storage axis would leave)."""
        d = self._store_dim(k, g)
        if d is None or not self.cfg.storage_axis:
            return g
        size = g.shape[d] // self.cfg._size(self.cfg.storage_axis)
        return lax.dynamic_slice_in_dim(g, lax.axis_index(self.cfg.storage_axis) * size, size, axis=d)

    # -- where the blocks live over pp ---------------------------------------------------------

    def _block_leaf(self, k: int, c: int, r: int) -> int:
        """The leaf that template leaf `k` (of blocks 0 .. per_stage - 1) is in chunk `c` of pp rank `r`."""
        b, p = self.position[k]
        return self.block_leaves[(c * self.cfg.pp + r) * self.per_stage + b][p]

    def _pp_dim(self, leaf) -> int | None:
        """The dimension of a block leaf's tp piece split over pp (each rank stores 1/pp of every
        block; the stage's owner collects them): the largest that divides, another than the storage
        dimension if one does; None (replicated over pp) for a leaf of the embedding or head, or
        when nothing divides."""
        if leaf.path[0] != self.units.blocks:
            return None
        pp = self.cfg.pp
        n_store = self.cfg._size(self.cfg.storage_axis) if self.cfg.storage_axis else 1
        fits = [d for d in range(len(leaf.local)) if d != leaf.store_dim and leaf.local[d] % pp == 0]
        if fits:
            return max(fits, key=lambda d: (leaf.local[d], -d))
        if leaf.store_dim is not None and leaf.local[leaf.store_dim] % (pp * n_store) == 0:
            return leaf.store_dim
        return None

    def _spec(self, leaf) -> P:
        """The engine's placement, plus pp on `_pp_dim` (inside tp, outside the storage axis, so a
        gather over the storage axis gives this rank's contiguous pp piece)."""
        dims = list(super()._spec(leaf))
        dims += [None] * (len(leaf.shape) - len(dims))
        d = self._pp_dim(leaf)
        if d is not None:
            axes = dims[d] if isinstance(dims[d], tuple) else (() if dims[d] is None else (dims[d],))
            tp = tuple(a for a in axes if a == self.cfg.tp_axis)
            dims[d] = (*tp, self.cfg.pp_axis, *(a for a in axes if a != self.cfg.tp_axis))
            dims[d] = dims[d][0] if len(dims[d]) == 1 else dims[d]
        return P(*dims)

    def _shift(self, parts: list, s: int, tok):
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

    def _stage_weights(self, w: dict, rank, tok):
        """Per template leaf, this rank's chunks' whole tp pieces `(v, ...)`: a block split over pp is
        put together from every rank's piece (pp - 1 shifted sendrecvs: an all-to-all), a block
        replicated over pp is picked."""
        pp, v = self.cfg.pp, self.cfg.virtual
        keys = [(k, c) for k in self.stage_leaves if self.pp_dims[k] is not None for c in range(v)]
        mine = {key: jnp.stack([w[self._block_leaf(*key, r)] for r in range(pp)]) for key in keys}
        got = {key: [mine[key][rank]] for key in keys}  # shift 0: this rank's own piece
        for s in range(1, pp):
            parts = [lax.dynamic_index_in_dim(mine[key], (rank + s) % pp, keepdims=False) for key in keys]
            parts, tok = self._shift(parts, s, tok)
            for key, x in zip(keys, parts, strict=True):
                got[key].append(x)  # piece (rank - s) of this rank's block

        def whole(k, c):
            if self.pp_dims[k] is None:
                return jnp.stack([w[self._block_leaf(k, c, r)] for r in range(pp)])[rank]
            by_shift = jnp.stack(got[(k, c)])
            pieces = [by_shift[(rank - j) % pp] for j in range(pp)]
            return jnp.concatenate(pieces, axis=self.pp_dims[k])

        return {k: jnp.stack([whole(k, c) for c in range(v)]) for k in self.stage_leaves}, tok

    def _stage_grads(self, dw: dict, rank, tok):
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
            parts, tok = self._shift(parts, s, tok)
            for key, x in zip(keys, parts, strict=True):
                got[key].append(x)  # this rank's piece of the block of rank (rank - s)
        for k, c in keys:
            by_shift = jnp.stack(got[(k, c)])
            for r in range(pp):
                grads[self._block_leaf(k, c, r)] = by_shift[(rank - r) % pp]
        for k in self.stage_leaves:
            if self.pp_dims[k] is None:
                every, tok = comm.all_gather(dw[k], self.cfg.pp_axis, tok, tiled=False, backend=self.cfg.backend)
                for r in range(pp):
                    for c in range(v):
                        grads[self._block_leaf(k, c, r)] = every[r, c]
        return grads, tok


def _mean_over(tree: dict, axes, tok, backend):
    """`tree`'s arrays averaged over `axes`: one all-reduce per dtype."""
    out = dict(tree)
    for keys in by_dtype(sorted(tree), tree):
        flat = jnp.concatenate([tree[k].reshape(-1) for k in keys])
        flat, tok = comm.all_reduce(flat, axes, tok, op="mean", backend=backend)
        offset = 0
        for k in keys:
            out[k] = flat[offset : offset + tree[k].size].reshape(tree[k].shape)
            offset += tree[k].size
    return out, tok
