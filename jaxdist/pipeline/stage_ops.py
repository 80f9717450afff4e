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

Stages whose blocks differ in code or static attributes (a Gemma's local and global layers: their
window and rotary base) run their own variant of each op: a stage runs the code of the first stage
whose blocks are of the same kinds, on its own weights (`stage_variants`). Variants whose residuals
(or split-backward values) have the same avals share their slots.
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


def branch_code(kind: str, position: int, variant: int = 0) -> int:
    """The code of op `kind` on a stage at `position` running the code of variant `variant` (0: idle)."""
    return 1 + 3 * (3 * variant + OPS.index(kind)) + position


def decode_branch(code: int) -> tuple[str, int, int]:
    """`(kind, position, variant)` of a `branch_code`."""
    op, position = divmod(code - 1, 3)
    variant, kind = divmod(op, 3)
    return OPS[kind], position, variant


def stage_variants(block_kinds, per_stage: int, stages: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each stage's variant (stages whose blocks are of the same kinds, in order, share one) and each
    variant's first block (that of the first stage of it, whose code the variant runs)."""
    signatures, variants, starts = [], [], []
    for s in range(stages):
        signature = tuple(block_kinds[s * per_stage : (s + 1) * per_stage])
        if signature not in signatures:
            signatures.append(signature)
            starts.append(s * per_stage)
        variants.append(signatures.index(signature))
    return tuple(variants), tuple(starts)


def _groups(signatures: list) -> tuple[list[int], list]:
    """Each item's group (items of equal signature share one) and each group's signature."""
    distinct = []
    for sig in signatures:
        if sig not in distinct:
            distinct.append(sig)
    return [distinct.index(sig) for sig in signatures], distinct


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
        self.variant_starts = grads.variant_starts  # per variant: the first block whose code it runs
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
        variants = range(len(self.variant_starts))
        # per variant, per block: (vjp tree, dropped residuals, kept avals); variants with equal kept avals
        # share one set of residual slots (`res_group`)
        blocks = range(self.per_stage)
        self.residuals = (
            [[self._residual_layout(j, v, micro_aval) for j in blocks] for v in variants] if layouts else []
        )
        self.res_group, self.res_avals = _groups([tuple(tuple(r[2]) for r in rs) for rs in self.residuals])
        self.backward_split = [self._split(v, micro_aval) for v in variants] if self.split else None
        if self.split:
            self.cot_group, self.cot_avals = _groups([tuple(bs.boundary) for bs in self.backward_split])

    # -- the model's parts ------------------------------------------------------------------

    def block_fn(self, j: int, v: int = 0):
        """Block j of a stage of variant v as `fn(w, x, b) -> (y, None)` (`jaxdist.engine.residuals`' form):
        the code of the variant's block, on the template's weights of block j."""
        i = self.variant_starts[v] + j
        names = list(zip(self.code.block_leaves[j], self.code.block_leaves[i], strict=True))

        def fn(wj, x, b):
            wi = {k_i: wj[k_j] for k_j, k_i in names}
            return self.code.block(i, wi, x, b, self.blocks_in[i])[0], None

        return fn

    def block_weights(self, cw: dict, j: int) -> dict:
        return {k: cw[k] for k in self.code.block_leaves[j]}

    def blocks(self, cw, x, b, v: int):
        for j in range(self.per_stage):
            x, _ = self.block_fn(j, v)(self.block_weights(cw, j), x, b)
        return x

    def embed(self, ew, b):
        return self.code.embed(ew, b, self.outer_in)[0]

    def head(self, hw, x, b):
        return self.code.head(hw, x, b, self.outer_in)[0]

    # -- residuals ----------------------------------------------------------------------------

    def _residual_layout(self, j: int, v: int, micro_aval) -> tuple:
        """Block j's vjp in variant v: its tree, which residuals are the weights' own (rebuilt, not kept),
        and the avals of the kept ones."""
        wj = {
            k: jax.ShapeDtypeStruct(self.chunks[k].shape[1:], self.chunks[k].dtype) for k in self.code.block_leaves[j]
        }
        fn, trees = self.block_fn(j, v), []

        def leaves(wj, x, b):
            flat, tree = jax.tree.flatten(jax.vjp(lambda w, x: fn(w, x, b), wj, x, has_aux=True)[1])
            trees.append(tree)
            return flat

        avals = jax.eval_shape(leaves, wj, self.x_aval, micro_aval)
        drop = weight_only(fn, wj, self.x_aval, micro_aval) if self.keep else (False,) * len(avals)
        if len(drop) != len(avals):
            raise AssertionError(f"block {j}: {len(avals)} residuals, the analysis traced {len(drop)}")
        return trees[0], drop, [a for a, d in zip(avals, drop, strict=True) if not d]

    def forward_vjps(self, cw, x, b, v: int):
        """The stage's blocks (variant v) on `x`: the output, each block's vjp, and each block's kept
        residuals (all its residuals when recomputing: the split backward's inputs)."""
        vjps, kept = [], []
        for j in range(self.per_stage):
            fn = self.block_fn(j, v)
            x, vjp, _ = jax.vjp(lambda w, x, fn=fn: fn(w, x, b), self.block_weights(cw, j), x, has_aux=True)
            vjps.append(vjp)
            if self.res_avals:
                drop = self.residuals[v][j][1]
                kept.append([leaf for leaf, d in zip(jax.tree.leaves(vjp), drop, strict=True) if not d])
        return x, vjps, kept

    def store_residuals(self, st, slot, kept, v: int):
        g = self.res_group[v]
        group = [
            [_put(buf, leaf, slot) for buf, leaf in zip(bufs, leaves, strict=True)]
            for bufs, leaves in zip(st["res"][g], kept, strict=True)
        ]
        return {**st, "res": [group if h == g else bufs for h, bufs in enumerate(st["res"])]}

    def stored(self, st, slot, v: int) -> list:
        """Each block's kept residuals (variant v) in `slot`."""
        return [[_index(buf, slot) for buf in bufs] for bufs in st["res"][self.res_group[v]]]

    def vjps_on(self, cw, kept, b, v: int) -> list:
        """Each block's vjp (variant v) on its kept residuals, the weights' own rebuilt from `cw`."""
        vjps = []
        for j, (tree, drop, _) in enumerate(self.residuals[v]):
            leaves = iter(kept[j])
            full = [None if d else next(leaves) for d in drop]
            fresh = weight_only_values(self.block_fn(j, v), self.block_weights(cw, j), self.x_aval, b, drop)
            vjps.append(rebuild(tree, full, fresh))
        return vjps

    def stored_vjps(self, st, slot, cw, b, v: int):
        """Each block's vjp (variant v) on the residuals in `slot`, the weights' own rebuilt from `cw`."""
        return self.vjps_on(cw, self.stored(st, slot, v), b, v)

    def _split(self, v: int, micro_aval) -> SplitBackward:
        """The stage's backward (variant v) on its kept residuals, split into B and W (`backward_split`)."""

        def bwd(cw, kept, dy, b):
            dx, dws = self.backward_through(self.vjps_on(cw, kept, b, v), dy)
            return {k: g for d in dws for k, g in d.items()}, dx

        cw = {k: jax.ShapeDtypeStruct(self.chunks[k].shape[1:], self.chunks[k].dtype) for k in self.template}
        kept = [avals for _, _, avals in self.residuals[v]]
        return SplitBackward(bwd, cw, kept, self.x_aval, micro_aval)

    def initial_boundary(self) -> list:
        n = self.plan.slots["cot"]
        return [[jnp.zeros((n, *a.shape), a.dtype) for a in avals] for avals in self.cot_avals]

    def initial_residuals(self) -> list:
        n = self.plan.res_slots
        return [[[jnp.zeros((n, *a.shape), a.dtype) for a in avals] for avals in group] for group in self.res_avals]

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
            # the loss is reported in float32, whatever the model computes in (float64 too)
            st["loss"] = st["loss"] + (loss / self.m).astype(st["loss"].dtype)
        return st

    # -- the ops -------------------------------------------------------------------------------

    def branch(self, code: int):
        """Table entry `code` as `run(st, row) -> (st, out)`; `row` holds this rank's chunk, micro-batch
        and slots at the tick, `out` what the op sends (zeros: nothing)."""
        kind, position, v = decode_branch(code)

        def run(st, row):
            c, i = row["chunk"], row["microbatch"]
            b = jax.tree.map(lambda x: _index(x, i), self.micro)
            cw = {k: _index(self.chunks[k], c) for k in self.template}
            x = self.embed(self.embed_w, b) if position == FIRST else _index(st["acts"], row["act_slot"])
            if kind == "F":
                return self.forward(st, row, position, v, cw, x, b)
            if kind == "B":
                return self.backward(st, row, position, v, cw, x, b)
            return self.weight_gradient(st, row, v, cw, x, b), self.zeros_x

        return run

    def forward(self, st, row, position, v, cw, x, b):
        if self.keep:
            y, _, kept = self.forward_vjps(cw, x, b, v)
            st = self.store_residuals(st, row["res_slot"], kept, v)
        else:
            y = self.blocks(cw, x, b, v)
        if position != LAST:
            return st, y
        # the last stage's F ends in the head: the loss, the head's gradient and the output gradient its
        # B starts from (kept in a gradient slot, as a later stage's would arrive), so F and B cost
        # what the table's ticks assume
        loss, head_vjp = jax.vjp(lambda hw, y: self.head(hw, y, b), self.head_w, y)
        d_hw, dy = head_vjp(self.seed.astype(loss.dtype))
        st = {**st, "grads": _put(st["grads"], dy, row["grad_slot"])}
        return self.add(st, row["chunk"], (), d_hw, loss), self.zeros_x

    def backward(self, st, row, position, v, cw, x, b):
        c, d_ow = row["chunk"], {}
        dy = _index(st["grads"], row["grad_slot"])
        if self.split:
            kept = self.stored(st, row["res_slot"], v) if self.keep else self.forward_vjps(cw, x, b, v)[2]
        else:
            vjps = self.stored_vjps(st, row["res_slot"], cw, b, v) if self.keep else self.forward_vjps(cw, x, b, v)[1]
        dws = ()
        if self.split:  # the input gradient's equations only; W's read what they need from the slot
            dx, boundary = self.backward_split[v].input_gradient(cw, kept, dy, b)
            g, slot = self.cot_group[v], row["cot_slot"]
            group = [_put(buf, value, slot) for buf, value in zip(st["cots"][g], boundary, strict=True)]
            st = {**st, "cots": [group if h == g else bufs for h, bufs in enumerate(st["cots"])]}
        else:
            dx, dws = self.backward_through(vjps, dy)
        if position == FIRST:
            _, embed_vjp = jax.vjp(lambda ew: self.embed(ew, b), self.embed_w)
            (d_ow,) = embed_vjp(dx)
            dx = self.zeros_x
        return self.add(st, c, dws, d_ow), dx

    def weight_gradient(self, st, row, v, cw, x, b):
        kept = self.stored(st, row["res_slot"], v) if self.keep else self.forward_vjps(cw, x, b, v)[2]
        boundary = [_index(buf, row["cot_slot"]) for buf in st["cots"][self.cot_group[v]]]
        d_cw = self.backward_split[v].weight_gradient(cw, kept, boundary, b)
        return self.add(st, row["chunk"], [d_cw])
