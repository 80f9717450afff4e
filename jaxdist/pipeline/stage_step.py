"""The pipeline's per-device program: the schedule table's ticks in order, inside the engine's
`shard_map`, given to `jaxdist.engine.step.train_step` in place of the engine's unit loop.

At a tick every rank runs its table entry (a `lax.switch` on its pp rank), then the tick's
activations and gradients move between neighbouring stages in one `comm.sendrecv`, on one token
chain that orders the ticks. A stage keeps only the inputs it received, in slots the table assigns
(`tick_plan`), and its backward recomputes the stage's forward from that input; the last stage's
forward runs inside its backward. A rank's stage gradients are averaged over the data axes in the
tick of its last op.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdist import comm
from jaxdist.compat import model_sharding_dropped
from jaxdist.engine.options import Options, axis_arg
from jaxdist.engine.run import EngineParts
from jaxdist.engine.unit_comm import by_dtype
from jaxdist.pipeline import schedule as ps
from jaxdist.pipeline.placement import StagePlacement

IDLE, F_FIRST, F_MID, F_LAST, B_FIRST, B_MID, B_LAST = range(7)


@dataclasses.dataclass(frozen=True)
class TickPlan:
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


def tick_plan(s: ps.Schedule) -> TickPlan:
    """The table as the arrays the step indexes by pp rank. A received message takes the lowest free
    slot of its kind on its rank; the backward of its (stage, micro-batch) frees it."""
    shape = (len(s.ticks), s.pp)
    arrays = {
        k: np.zeros(shape, np.int32) for k in TickPlan.__dataclass_fields__ if k not in ("act_slots", "grad_slots")
    }
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
    return TickPlan(**arrays, act_slots=most[ps.ACTIVATION], grad_slots=most[ps.GRADIENT])


def micro_avals(cfg: Options, local):
    """One micro-batch's avals of a data rank's batch `local`; rows that do not split raise."""
    m = cfg.microbatches
    rows = jax.tree.leaves(local)[0].shape[0]
    if rows % m:
        raise ValueError(
            f"Pipelined: each data rank's {rows} rows do not split into microbatches={m}; change the batch "
            "size or the micro-batch count"
        )
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] // m, *a.shape[1:]), a.dtype), local)


def as_microbatches(m: int, batch):
    """A data rank's batch as `m` micro-batches along a new leading axis."""
    return jax.tree.map(lambda a: a.reshape(m, a.shape[0] // m, *a.shape[1:]), batch)


def summed_dtype(cfg: Options, dtype):
    """The dtype micro-batch gradients are summed in: reduce_dtype where it is the wider (float32 for
    bfloat16 compute), since a bfloat16 sum would lose what reducing in float32 keeps."""
    return jnp.promote_types(dtype, cfg.reduce_dtype or dtype)


class _Ticks:
    """One trace of the schedule: this rank's weights and micro-batches, and each branch of the table."""

    def __init__(self, grads: ScheduleGrads, w: dict, chunks: dict, batch, model_state):
        self.grads, self.cfg, self.code = grads, grads.cfg, grads.parts.code
        self.m = self.cfg.microbatches
        self.template = grads.placement.stage_leaves
        self.chunks = chunks
        self.embed_w = {k: w[k] for k in self.code.embed_leaves}
        self.head_w = {k: w[k] for k in self.code.head_leaves}
        self.outer_keys = sorted(set(self.code.embed_leaves) | set(self.code.head_leaves))
        self.micro = as_microbatches(self.m, batch)
        self.outer_in, self.blocks_in = model_state["outer"], model_state["blocks"]
        # this step's batch may differ in size from prepare's example: the activations' shape follows it
        self.x_aval = grads.x_aval(
            micro_avals(self.cfg, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch))
        )
        self.zeros_x = jnp.zeros(self.x_aval.shape, self.x_aval.dtype)
        self.seed = jnp.asarray(1.0 / self.m)  # the global batch mean is the mean of the micro-batch means
        self.data_axes = axis_arg(self.cfg.data_axes) if self.cfg.data_axes else ()

    def blocks(self, cw, x, b):
        """The stage's blocks on chunk weights `cw` (template leaves)."""
        for i in range(self.grads.placement.per_stage):
            x, _ = self.code.block(i, {k: cw[k] for k in self.code.block_leaves[i]}, x, b, self.blocks_in[i])
        return x

    def embed(self, ew, b):
        return self.code.embed(ew, b, self.outer_in)[0]

    def head(self, hw, x, b):
        return self.code.head(hw, x, b, self.outer_in)[0]

    def first_stage(self, ew, cw, b):
        return self.blocks(cw, self.embed(ew, b), b)

    def last_stage(self, hw, cw, x, b):
        return self.head(hw, self.blocks(cw, x, b), b)

    def initial(self, w: dict) -> dict:
        """The scan's state: the received activations and gradients (slots), the summed gradients, the loss."""
        plan, v = self.grads.plan, self.cfg.virtual

        def x_slots(n):
            return jnp.zeros((n, *self.x_aval.shape), self.x_aval.dtype)

        chunks = self.chunks
        return {
            "acts": x_slots(plan.act_slots),
            "grads": x_slots(plan.grad_slots),
            "dw": {
                k: jnp.zeros((v, *chunks[k].shape[1:]), summed_dtype(self.cfg, chunks[k].dtype)) for k in self.template
            },
            "douter": {k: jnp.zeros(w[k].shape, summed_dtype(self.cfg, w[k].dtype)) for k in self.outer_keys},
            "loss": jnp.zeros((), jnp.float32),
        }

    def add(self, st, c, d_cw, d_ow=None, loss=None):
        st = dict(st)
        st["dw"] = {k: st["dw"][k].at[c].add(d_cw[k]) for k in self.template}
        if d_ow:
            st["douter"] = {k: st["douter"][k] + d_ow.get(k, 0) for k in self.outer_keys}
        if loss is not None:
            st["loss"] = st["loss"] + loss / self.m
        return st

    def branch(self, kind: int):
        """The table entry `kind` as `run(st, chunk, microbatch, act_slot, grad_slot) -> (st, out)`."""

        def run(st, c, i, a, g):
            b = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False), self.micro)
            cw = {k: lax.dynamic_index_in_dim(self.chunks[k], c, keepdims=False) for k in self.template}
            x, dy = st["acts"][a], st["grads"][g]
            if kind == F_FIRST:
                return st, self.blocks(cw, self.embed(self.embed_w, b), b)
            if kind == F_MID:
                return st, self.blocks(cw, x, b)
            if kind == B_FIRST:
                _, vjp = jax.vjp(lambda ew, cw: self.first_stage(ew, cw, b), self.embed_w, cw)
                d_ew, d_cw = vjp(dy)
                return self.add(st, c, d_cw, d_ew), self.zeros_x
            if kind == B_MID:
                _, vjp = jax.vjp(lambda cw, x: self.blocks(cw, x, b), cw, x)
                d_cw, dx = vjp(dy)
                return self.add(st, c, d_cw), dx
            if kind == B_LAST:
                loss, vjp = jax.vjp(lambda hw, cw, x: self.last_stage(hw, cw, x, b), self.head_w, cw, x)
                d_hw, d_cw, dx = vjp(self.seed.astype(loss.dtype))
                return self.add(st, c, d_cw, d_hw, loss), dx
            return st, self.zeros_x  # idle, and the last stage's forward (run inside its backward)

        return run

    def exchange(self, perm):
        """The tick's sendrecv over pp for one of the table's patterns (none: nothing arrives)."""

        def run(out, tok):
            if not perm:
                return jnp.zeros_like(out), tok
            return comm.sendrecv(out, self.cfg.pp_axis, tok, perm=perm, backend=self.cfg.backend)

        return run

    def average_stages(self, st, tok):
        """The rank's stage gradients averaged over the data axes in reduce_dtype (one all-reduce per dtype)."""
        cfg = self.cfg
        dw = {k: x.astype(cfg.reduce_dtype or x.dtype) for k, x in st["dw"].items()}
        dw, tok = mean_over(dw, self.data_axes, tok, cfg.backend)
        return {**st, "dw": {k: x.astype(st["dw"][k].dtype) for k, x in dw.items()}}, tok

    def run(self, st, rank, tok):
        """The table's ticks, one traced tick scanned over its rows; a tick's communication is one of the
        table's distinct sendrecv patterns (a switch uniform over pp, so every rank takes the same one)."""
        s, plan = self.grads.table, self.grads.plan
        perms = sorted({t.perm() for t in s.ticks})
        pattern = np.asarray([perms.index(t.perm()) for t in s.ticks], np.int32)
        rows = (plan.branch, plan.chunk, plan.microbatch, plan.act_slot, plan.grad_slot, plan.recv_kind)
        branches = [self.branch(k) for k in range(B_LAST + 1)]
        exchanges = [self.exchange(p) for p in perms]

        def unchanged(st, tok):
            return st, tok

        def tick(carry, row):
            st, tok = carry
            (kind, c, i, a, g, got_kind), slot, which = [x[rank] for x in row[:6]], row[6][rank], row[7]
            st, out = lax.switch(kind, branches, st, c, i, a, g)
            got, tok = lax.switch(which, exchanges, out, tok)
            for code, name in ((1, "acts"), (2, "grads")):
                keep = lax.dynamic_index_in_dim(st[name], slot, keepdims=False)
                new = jnp.where(got_kind == code, got, keep)
                st = {**st, name: lax.dynamic_update_index_in_dim(st[name], new, slot, 0)}
            if self.cfg.data_axes:  # after the rank's last op, while the other stages still run the cool-down
                st, tok = lax.cond(row[8][rank] == 1, self.average_stages, unchanged, st, tok)
            return (st, tok), None

        xs = tuple(jnp.asarray(x) for x in (*rows, plan.recv_slot, pattern, plan.done))
        (st, tok), _ = lax.scan(tick, (st, tok), xs)
        return st, tok


class ScheduleGrads:
    """The pipeline's per-device program for `jaxdist.engine.step.train_step`:
    `grads(params, model_state, step, batch) -> (gradient pieces, model_state, {"loss"})`.

    Args:
      cfg: the pipeline's options; parts: the engine's parts of the run.
      table, plan: the schedule and its arrays (`tick_plan`); placement: the blocks over pp.
    """

    def __init__(self, cfg: Options, parts: EngineParts, table: ps.Schedule, plan: TickPlan, placement: StagePlacement):
        self.cfg, self.parts, self.table, self.plan, self.placement = cfg, parts, table, plan, placement

    def x_aval(self, micro):
        """The activations' aval between stages for micro-batches of avals `micro`."""
        code = self.parts.code
        return jax.eval_shape(code.embed_shape, self.parts.layout.avals(code.embed_leaves, whole=True), micro)

    @model_sharding_dropped()  # the per-device program: the model's own sharding annotations are no-ops
    def __call__(self, params, model_state, step, batch):
        cfg, parts = self.cfg, self.parts
        rank = lax.axis_index(cfg.pp_axis)
        gather, reduce = parts.comm.gather, parts.comm.reduce
        tok = comm.token()
        handle, tok = gather.start(dict(enumerate(jax.tree.leaves(params))), tok)
        w, tok = gather.wait(handle, tok)  # every piece whole over the storage axis, kept for the step
        chunks, tok = self.placement.stage_weights(w, rank, tok)  # leaf of the template blocks -> (v, *tp piece)
        ticks = _Ticks(self, w, chunks, batch, model_state)
        st, tok = ticks.run(ticks.initial(w), rank, tok)

        # each block's gradient (already averaged over the data axes) back to the pp pieces it is
        # stored in, then this rank's share of the storage axis; embedding and head summed over pp
        # and reduced over the data axes as the engine reduces a unit's
        grads, tok = self.placement.stage_grads(st["dw"], rank, tok)
        grads = {k: self.storage_share(k, g) for k, g in grads.items()}
        outer = {}
        for k in ticks.outer_keys:
            outer[k], tok = comm.all_reduce(st["douter"][k], cfg.pp_axis, tok, op="sum", backend=cfg.backend)
        handle, tok = reduce.start(outer, tok)
        outer, tok = reduce.wait(handle, tok)
        grads.update(outer)
        loss, tok = comm.all_reduce(st["loss"], cfg.pp_axis, tok, op="sum", backend=cfg.backend)
        if cfg.data_axes:
            loss, tok = comm.all_reduce(loss, ticks.data_axes, tok, op="mean", backend=cfg.backend)
        leaves = parts.layout.leaves
        out = [grads[k].astype(leaves[k].dtype) for k in range(len(leaves))]
        return parts.layout.unflatten(out), model_state, {"loss": loss}

    def storage_share(self, k: int, g):
        """This rank's slice of a gradient already averaged over the data axes, along the storage
        dimension (the slice a reduce-scatter over the storage axis would leave)."""
        d = self.parts.layout.store_dim(k, g)
        if d is None or not self.cfg.storage_axis:
            return g
        size = g.shape[d] // self.cfg.size(self.cfg.storage_axis)
        return lax.dynamic_slice_in_dim(g, lax.axis_index(self.cfg.storage_axis) * size, size, axis=d)


def mean_over(tree: dict, axes, tok, backend):
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
