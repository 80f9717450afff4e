"""What one op of a pipeline table does on a rank: a stage's forward `F`, its backward `B` (the input
gradient, and with it the weight gradient unless the table has `W` ops) and its weight gradient `W`,
on this rank's chunk weights, the micro-batch, and the slots the table assigns (`stage_step.tick_plan`).

Activations: a stage's blocks run one `jax.vjp` each. Kept (the default) the forward stores the
vjps' residuals in a residual slot until the op that needs them last (B, or W in a split table),
except those computed from the weights alone (casts, the kernels themselves), which that op rebuilds
from the chunk weights (`jaxdist.engine.residuals`) instead of keeping a copy of the weights per
micro-batch; so the backward runs no second forward. Recomputed (`remat=True`) the forward stores
nothing and the backward (and W) replay the stage's forward from the kept input. Either way the
embedding's backward replays the embedding (a lookup). The last stage's F also runs the head, its loss
and gradient, and keeps the output gradient its B starts from.

B of a split table runs only the equations of the stage's backward that its input gradient needs,
passing the values W's equations read (the layers' output gradients) in a slot; W runs the rest
(`backward_split`). The embedding's and the head's weight gradients are computed in B.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxdist.engine.options import axis_arg
from jaxdist.engine.residuals import rebuild, weight_only, weight_only_values
from jaxdist.pipeline.backward_split import SplitBackward

IDLE = 0
FIRST, MID, LAST = range(3)  # a stage's position: the first (with the embedding), the last (with the head)
OPS = ("F", "B", "W")


def branch_code(kind: str, position: int) -> int:
    """The code of op `kind` on a stage at `position` (0: idle)."""
    return 1 + 3 * OPS.index(kind) + position


def summed_dtype(cfg, dtype):
    """The dtype micro-batch gradients are summed in: reduce_dtype where it is the wider (float32 for
    bfloat16 compute), since a bfloat16 sum would lose what reducing in float32 keeps."""
    return jnp.promote_types(dtype, cfg.reduce_dtype or dtype)


def as_microbatches(m: int, batch):
    """A data rank's batch as `m` micro-batches along a new leading axis."""
    return jax.tree.map(lambda a: a.reshape(m, a.shape[0] // m, *a.shape[1:]), batch)


def _index(x, i):
    return lax.dynamic_index_in_dim(x, i, keepdims=False)


def _put(buf, value, i):
    return lax.dynamic_update_index_in_dim(buf, value.astype(buf.dtype), i, 0)


class StageOps:
    """One trace of the schedule's ops: this rank's weights and micro-batches, and each branch.

    Args:
      grads: the schedule's program (`stage_step.ScheduleGrads`: options, parts, plan, placement).
      w: every piece whole over the storage axis; chunks: template leaf -> (v, *tp piece).
      batch: this data rank's batch; model_state: the step's variables.
      micro_aval: one micro-batch's avals; x_aval: the activations' aval between stages.
    """

    def __init__(self, grads, w: dict, chunks: dict, batch, model_state, micro_aval, x_aval):
        self.cfg, self.code, self.plan = grads.cfg, grads.parts.code, grads.plan
        self.keep, self.split = grads.keep, grads.table.split
        self.m = self.cfg.microbatches
        self.per_stage = grads.placement.per_stage
        self.template = grads.placement.stage_leaves
        self.chunks = chunks
        self.embed_w = {k: w[k] for k in self.code.embed_leaves}
        self.head_w = {k: w[k] for k in self.code.head_leaves}
        self.outer_keys = sorted(set(self.code.embed_leaves) | set(self.code.head_leaves))
        self.micro = as_microbatches(self.m, batch)
        self.outer_in, self.blocks_in = model_state["outer"], model_state["blocks"]
        self.x_aval = x_aval
        self.zeros_x = jnp.zeros(x_aval.shape, x_aval.dtype)
        self.seed = jnp.asarray(1.0 / self.m)  # the global batch mean is the mean of the micro-batch means
        self.data_axes = axis_arg(self.cfg.data_axes) if self.cfg.data_axes else ()
        layouts = self.keep or self.split
        self.residuals = [self._residual_layout(j, micro_aval) for j in range(self.per_stage)] if layouts else []
        self.backward_split = self._split(micro_aval) if self.split else None

    # -- the model's parts ------------------------------------------------------------------

    def block_fn(self, j: int):
        """Block j of a stage as `fn(w, x, b) -> (y, None)` (`jaxdist.engine.residuals`' form)."""

        def fn(wj, x, b):
            return self.code.block(j, wj, x, b, self.blocks_in[j])[0], None

        return fn

    def block_weights(self, cw: dict, j: int) -> dict:
        return {k: cw[k] for k in self.code.block_leaves[j]}

    def blocks(self, cw, x, b):
        for j in range(self.per_stage):
            x, _ = self.block_fn(j)(self.block_weights(cw, j), x, b)
        return x

    def embed(self, ew, b):
        return self.code.embed(ew, b, self.outer_in)[0]

    def head(self, hw, x, b):
        return self.code.head(hw, x, b, self.outer_in)[0]

    # -- residuals ----------------------------------------------------------------------------

    def _residual_layout(self, j: int, micro_aval) -> tuple:
        """Block j's vjp: its tree, which residuals are the weights' own (rebuilt, not kept), and the
        avals of the kept ones."""
        wj = {
            k: jax.ShapeDtypeStruct(self.chunks[k].shape[1:], self.chunks[k].dtype) for k in self.code.block_leaves[j]
        }
        fn, trees = self.block_fn(j), []

        def leaves(wj, x, b):
            flat, tree = jax.tree.flatten(jax.vjp(lambda w, x: fn(w, x, b), wj, x, has_aux=True)[1])
            trees.append(tree)
            return flat

        avals = jax.eval_shape(leaves, wj, self.x_aval, micro_aval)
        drop = weight_only(fn, wj, self.x_aval, micro_aval) if self.keep else (False,) * len(avals)
        if len(drop) != len(avals):
            raise AssertionError(f"block {j}: {len(avals)} residuals, the analysis traced {len(drop)}")
        return trees[0], drop, [a for a, d in zip(avals, drop, strict=True) if not d]

    def forward_vjps(self, cw, x, b):
        """The stage's blocks on `x`: the output, each block's vjp, and each block's kept residuals
        (all its residuals when recomputing: the split backward's inputs)."""
        vjps, kept = [], []
        for j in range(self.per_stage):
            x, vjp, _ = jax.vjp(lambda w, x, j=j: self.block_fn(j)(w, x, b), self.block_weights(cw, j), x, has_aux=True)
            vjps.append(vjp)
            if self.residuals:
                drop = self.residuals[j][1]
                kept.append([leaf for leaf, d in zip(jax.tree.leaves(vjp), drop, strict=True) if not d])
        return x, vjps, kept

    def store_residuals(self, st, slot, kept):
        res = [
            [_put(buf, leaf, slot) for buf, leaf in zip(st["res"][j], kept[j], strict=True)] for j in range(len(kept))
        ]
        return {**st, "res": res}

    def stored(self, st, slot) -> list:
        """Each block's kept residuals in `slot`."""
        return [[_index(buf, slot) for buf in bufs] for bufs in st["res"]]

    def vjps_on(self, cw, kept, b) -> list:
        """Each block's vjp on its kept residuals, the weights' own rebuilt from `cw`."""
        vjps = []
        for j, (tree, drop, _) in enumerate(self.residuals):
            leaves = iter(kept[j])
            full = [None if d else next(leaves) for d in drop]
            fresh = weight_only_values(self.block_fn(j), self.block_weights(cw, j), self.x_aval, b, drop)
            vjps.append(rebuild(tree, full, fresh))
        return vjps

    def stored_vjps(self, st, slot, cw, b):
        """Each block's vjp on the residuals in `slot`, the weights' own rebuilt from `cw`."""
        return self.vjps_on(cw, self.stored(st, slot), b)

    def _split(self, micro_aval) -> SplitBackward:
        """The stage's backward on its kept residuals, split into B and W (`backward_split`)."""

        def bwd(cw, kept, dy, b):
            dx, dws = self.backward_through(self.vjps_on(cw, kept, b), dy)
            return {k: g for d in dws for k, g in d.items()}, dx

        cw = {k: jax.ShapeDtypeStruct(self.chunks[k].shape[1:], self.chunks[k].dtype) for k in self.template}
        kept = [avals for _, _, avals in self.residuals]
        return SplitBackward(bwd, cw, kept, self.x_aval, micro_aval)

    def initial_boundary(self) -> list:
        n = self.plan.slots["cot"]
        return [jnp.zeros((n, *a.shape), a.dtype) for a in self.backward_split.boundary]

    def initial_residuals(self) -> list:
        n = self.plan.res_slots
        return [[jnp.zeros((n, *a.shape), a.dtype) for a in avals] for _, _, avals in self.residuals]

    # -- gradients ------------------------------------------------------------------------------

    @staticmethod
    def backward_through(vjps, dy):
        """Backward through the blocks: the stage's input gradient and each block's weight gradient."""
        dws = [None] * len(vjps)
        for j in reversed(range(len(vjps))):
            dws[j], dy = vjps[j](dy)
        return dy, dws

    def add(self, st, c, dws=(), d_ow=None, loss=None):
        """`st` with block gradients `dws` (one dict per block) added to chunk c's, outer ones `d_ow`."""
        st = dict(st)
        if dws:
            d_cw = {k: g for d in dws for k, g in d.items()}
            st["dw"] = {k: st["dw"][k].at[c].add(d_cw[k]) for k in self.template}
        if d_ow:
            st["douter"] = {k: st["douter"][k] + d_ow.get(k, 0) for k in self.outer_keys}
        if loss is not None:
            st["loss"] = st["loss"] + loss / self.m
        return st

    # -- the ops -------------------------------------------------------------------------------

    def branch(self, code: int):
        """Table entry `code` as `run(st, row) -> (st, out)`; `row` holds this rank's chunk, micro-batch
        and slots at the tick, `out` what the op sends (zeros: nothing)."""
        kind, position = OPS[(code - 1) // 3], (code - 1) % 3

        def run(st, row):
            c, i = row["chunk"], row["microbatch"]
            b = jax.tree.map(lambda x: _index(x, i), self.micro)
            cw = {k: _index(self.chunks[k], c) for k in self.template}
            x = self.embed(self.embed_w, b) if position == FIRST else _index(st["acts"], row["act_slot"])
            if kind == "F":
                return self.forward(st, row, position, cw, x, b)
            if kind == "B":
                return self.backward(st, row, position, cw, x, b)
            return self.weight_gradient(st, row, cw, x, b), self.zeros_x

        return run

    def forward(self, st, row, position, cw, x, b):
        if self.keep:
            y, _, kept = self.forward_vjps(cw, x, b)
            st = self.store_residuals(st, row["res_slot"], kept)
        else:
            y = self.blocks(cw, x, b)
        if position != LAST:
            return st, y
        # the last stage's F ends in the head: the loss, the head's gradient and the output gradient its
        # B starts from (kept in a gradient slot, as a later stage's would arrive), so F and B cost
        # what the table's ticks assume
        loss, head_vjp = jax.vjp(lambda hw, y: self.head(hw, y, b), self.head_w, y)
        d_hw, dy = head_vjp(self.seed.astype(loss.dtype))
        st = {**st, "grads": _put(st["grads"], dy, row["grad_slot"])}
        return self.add(st, row["chunk"], (), d_hw, loss), self.zeros_x

    def backward(self, st, row, position, cw, x, b):
        c, d_ow = row["chunk"], {}
        dy = _index(st["grads"], row["grad_slot"])
        if self.split:
            kept = self.stored(st, row["res_slot"]) if self.keep else self.forward_vjps(cw, x, b)[2]
        else:
            vjps = self.stored_vjps(st, row["res_slot"], cw, b) if self.keep else self.forward_vjps(cw, x, b)[1]
        dws = ()
        if self.split:  # the input gradient's equations only; W's read what they need from the slot
            dx, boundary = self.backward_split.input_gradient(cw, kept, dy, b)
            st = {**st, "cots": [_put(buf, v, row["cot_slot"]) for buf, v in zip(st["cots"], boundary, strict=True)]}
        else:
            dx, dws = self.backward_through(vjps, dy)
        if position == FIRST:
            _, embed_vjp = jax.vjp(lambda ew: self.embed(ew, b), self.embed_w)
            (d_ow,) = embed_vjp(dx)
            dx = self.zeros_x
        return self.add(st, c, dws, d_ow), dx

    def weight_gradient(self, st, row, cw, x, b):
        kept = self.stored(st, row["res_slot"]) if self.keep else self.forward_vjps(cw, x, b)[2]
        boundary = [_index(buf, row["cot_slot"]) for buf in st["cots"]]
        d_cw = self.backward_split.weight_gradient(cw, kept, boundary, b)
        return self.add(st, row["chunk"], [d_cw])
