"""The pipeline's per-device program: the schedule table's ticks in order, inside the engine's
`shard_map`, given to `jaxdist.engine.step.train_step` in place of the engine's unit loop.

At a tick every rank runs its table entry (a `lax.switch` on its pp rank over the op kinds the table
uses, `stage_ops`), then the tick's activations and gradients move between neighbouring stages in
one `comm.sendrecv`, on one token chain that orders the ticks. What a stage keeps between its ops
lives in slots the table assigns (`tick_plan`): the inputs it received (and the last stage's
output gradient, from its F's head), its forward's residuals (activations kept, the default) and,
in a split table, the values W reads from B; each
slot is freed by the last op that reads it, so 1F1B's live activations are bounded by pp, not by
the micro-batch count. A rank's stage gradients are averaged over the data axes in the tick of its
last op.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdist import comm
from jaxdist.compat import model_sharding_dropped
from jaxdist.engine.options import Options
from jaxdist.engine.run import EngineParts
from jaxdist.engine.unit_comm import by_dtype
from jaxdist.pipeline import schedule as ps
from jaxdist.pipeline.placement import StagePlacement
from jaxdist.pipeline.stage_ops import FIRST, IDLE, LAST, MID, StageOps, branch_code, summed_dtype

SLOTS = ("act", "grad", "res", "cot")  # received activations and gradients, residuals, W's gradients


@dataclasses.dataclass(frozen=True)
class TickPlan:
    """Per tick, per pp rank: the branch, chunk, micro-batch, the slots its op reads or writes, and
    what arrives where; `slots`: how many of each kind a rank holds."""

    branch: np.ndarray  # (ticks, pp)
    chunk: np.ndarray
    microbatch: np.ndarray
    act_slot: np.ndarray
    grad_slot: np.ndarray
    res_slot: np.ndarray
    cot_slot: np.ndarray
    recv_kind: np.ndarray  # 0 nothing, 1 activation, 2 gradient
    recv_slot: np.ndarray
    done: np.ndarray  # 1 at the tick of the rank's last op: its stage gradients are final
    slots: dict

    @property
    def act_slots(self) -> int:
        return self.slots["act"]

    @property
    def res_slots(self) -> int:
        return self.slots["res"]


def _lifetimes(s: ps.Schedule, keep: bool, op: ps.Op) -> tuple[set, set]:
    """The slot kinds `op` frees (it reads them last) and those it fills."""
    last = op.stage == s.stages - 1
    if op.kind == ps.FORWARD:  # the last stage's F also fills a gradient slot: the head's output gradient
        fills = ({"res"} if keep else set()) | ({"grad"} if last else set())
        return ({"act"} if keep and op.stage > 0 else set()), fills
    if op.kind == ps.BACKWARD:
        if not s.split:  # the last op of the micro-batch's stage: whatever it held
            return {"grad", "act", "res"}, set()
        return {"grad"}, {"cot"}
    return {"res", "cot"} | (set() if keep else {"act"}), set()


def tick_plan(s: ps.Schedule, keep: bool = True, variants: tuple[int, ...] | None = None) -> TickPlan:
    """The table as the arrays the step indexes by pp rank. A slot of each kind is taken lowest-free
    by what fills it (a received message, the op that stores residuals or W's gradients) and freed by
    the op that reads it last; `keep`: the forward's residuals are kept (else recomputed from the
    received input, which then lives until the last backward op); `variants`: each stage's variant
    (`stage_ops.stage_variants`; default: every stage runs one program)."""
    variants = variants or (0,) * s.stages
    shape = (len(s.ticks), s.pp)
    arrays = {k: np.zeros(shape, np.int32) for k in TickPlan.__dataclass_fields__ if k != "slots"}
    most = dict.fromkeys(SLOTS, 0)
    last = s.stages - 1
    for r in range(s.pp):
        held: dict[tuple, int] = {}

        def take(kind, key, held=held):
            taken = {slot for k, slot in held.items() if k[0] == kind}
            slot = min(set(range(len(taken) + 1)) - taken)
            held[(kind, *key)] = slot
            most[kind] = max(most[kind], slot + 1)
            return slot

        final_tick = 0
        for t, tick in enumerate(s.ticks):
            op = tick.ops[r]
            if op is not None:
                key = (op.microbatch, op.stage)
                position = FIRST if op.stage == 0 else LAST if op.stage == last else MID
                if position == LAST and op.kind != ps.FORWARD:  # the head ran in the F: B and W as a middle stage's
                    position = MID
                arrays["branch"][t, r] = branch_code(op.kind, position, variants[op.stage])
                arrays["chunk"][t, r] = op.stage // s.pp
                arrays["microbatch"][t, r] = op.microbatch
                frees, fills = _lifetimes(s, keep, op)
                for kind in SLOTS:
                    arrays[f"{kind}_slot"][t, r] = held.get((kind, *key), 0)
                for kind in frees:
                    held.pop((kind, *key), None)
                for kind in sorted(fills):
                    arrays[f"{kind}_slot"][t, r] = take(kind, key)
                final_tick = t
            msg = tick.recvs[r]
            if msg is not None:
                kind = "act" if msg.kind == ps.ACTIVATION else "grad"
                arrays["recv_kind"][t, r] = 1 if kind == "act" else 2
                arrays["recv_slot"][t, r] = take(kind, (msg.microbatch, msg.stage))
        arrays["done"][final_tick, r] = 1
    return TickPlan(**arrays, slots={k: max(n, 1) for k, n in most.items()})


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


class _Ticks(StageOps):
    """The schedule's ticks over `StageOps`' branches: the scan's state and its loop."""

    def initial(self, w: dict) -> dict:
        """The scan's state: the slots, the summed gradients, the loss."""
        plan, v = self.plan, self.cfg.virtual

        def x_slots(n, *inner):
            return jnp.zeros((n, *inner, *self.x_aval.shape), self.x_aval.dtype)

        chunks = self.chunks
        st = {
            "acts": x_slots(plan.slots["act"]),
            "grads": x_slots(plan.slots["grad"]),
            "dw": {
                k: jnp.zeros((v, *chunks[k].shape[1:]), summed_dtype(self.cfg, chunks[k].dtype)) for k in self.template
            },
            "douter": {k: jnp.zeros(w[k].shape, summed_dtype(self.cfg, w[k].dtype)) for k in self.outer_keys},
            "loss": jnp.zeros((), jnp.float32),
        }
        if self.keep:
            st["res"] = self.initial_residuals()
        if self.split:
            st["cots"] = self.initial_boundary()
        return st

    def exchange(self, perm):
        """The tick's sendrecv over pp for one of the table's patterns (none: nothing arrives)."""

        def run(out, tok):
            if not perm:
                return jnp.zeros_like(out), tok
            return comm.sendrecv(out, self.cfg.pp_axis, tok, perm=perm, backend=self.cfg.backend)

        return run

    def average_stages(self, st, tok):
        """The rank's stage gradients averaged over the data axes in reduce_dtype (one all-reduce per dtype,
        or with `pack_units=False` one grouped all-reduce over them in place)."""
        cfg = self.cfg
        dw = {k: x.astype(cfg.reduce_dtype or x.dtype) for k, x in st["dw"].items()}
        dw, tok = mean_over(dw, self.data_axes, tok, cfg.backend, pack=cfg.pack_units)
        return {**st, "dw": {k: x.astype(st["dw"][k].dtype) for k, x in dw.items()}}, tok

    def idle(self, st, row):
        return st, self.zeros_x

    def run(self, st, rank, table: ps.Schedule, tok):
        """The table's ticks, one traced tick scanned over its rows; a tick's op is one of the branches
        the table uses, its communication one of the table's distinct sendrecv patterns (a switch
        uniform over pp, so every rank takes the same one)."""
        plan = self.plan
        perms = sorted({t.perm() for t in table.ticks})
        pattern = np.asarray([perms.index(t.perm()) for t in table.ticks], np.int32)
        codes = sorted(set(plan.branch.flat) | {IDLE})
        which_branch = np.asarray([codes.index(c) for c in plan.branch.flat], np.int32).reshape(plan.branch.shape)
        branches = [self.idle if c == IDLE else self.branch(c) for c in codes]
        exchanges = [self.exchange(p) for p in perms]
        names = ("chunk", "microbatch", *(f"{k}_slot" for k in SLOTS), "recv_kind", "recv_slot", "done")

        def unchanged(st, tok):
            return st, tok

        def tick(carry, xs):
            st, tok = carry
            row = {k: x[rank] for k, x in xs["rank"].items()}
            st, out = lax.switch(row["branch"], branches, st, row)
            got, tok = lax.switch(xs["pattern"], exchanges, out, tok)
            for code, name in ((1, "acts"), (2, "grads")):
                keep = lax.dynamic_index_in_dim(st[name], row["recv_slot"], keepdims=False)
                new = jnp.where(row["recv_kind"] == code, got, keep)
                st = {**st, name: lax.dynamic_update_index_in_dim(st[name], new, row["recv_slot"], 0)}
            if self.cfg.data_axes:  # after the rank's last op, while the other stages still run the cool-down
                st, tok = lax.cond(row["done"] == 1, self.average_stages, unchanged, st, tok)
            return (st, tok), None

        per_rank = {k: jnp.asarray(getattr(plan, k)) for k in names}
        per_rank["branch"] = jnp.asarray(which_branch)
        (st, tok), _ = lax.scan(tick, (st, tok), {"rank": per_rank, "pattern": jnp.asarray(pattern)})
        return st, tok

    def run_rank(self, st, rank: int, table: ps.Schedule, tok):
        """Pp rank `rank`'s column of the table with no switch: its ticks as code chosen when tracing.
        The column's repeating part (1F1B's steady state: F then B, again and again) is one `lax.scan`
        over its repetitions, whose slots and micro-batches are the scanned values; the ticks before and
        after it are straight-line code (`rank_segments`). A per-rank program: the process holding rank
        `rank` runs it, the other ranks' processes theirs, their sendrecvs paired tick by tick; the loop's
        trip count is known when compiling, and nothing in it waits for the host to choose a branch.
        In a loop, the table's slots bound the memory as in the one-program step (straight-line ticks
        leave XLA free to compute early and hold what later ticks read)."""
        kinds, indices = _rank_column(self.plan, table, rank)
        for start, period, repeats in rank_segments(kinds):
            if repeats == 1:
                st, tok = self._rank_tick(st, tok, kinds[start], indices[start])
                continue
            scanned = {
                k: jnp.asarray([[indices[start + i * period + j][k] for j in range(period)] for i in range(repeats)])
                for k in _INDICES
            }

            def body(carry, xs, pattern=kinds[start : start + period]):
                st, tok = carry
                for j, kind in enumerate(pattern):
                    st, tok = self._rank_tick(st, tok, kind, {k: v[j] for k, v in xs.items()})
                return (st, tok), None

            (st, tok), _ = lax.scan(body, (st, tok), scanned)
        return st, tok

    def _rank_tick(self, st, tok, kind: tuple, row: dict):
        """One tick of `run_rank`: `kind`'s op, sendrecv, receive and average (`_rank_column`) on `row`'s chunk,
        micro-batch and slots (Python ints, or a scan's values)."""
        code, perm, arrives, done = kind
        st, out = self.idle(st, row) if code == IDLE else self.branch(code)(st, row)
        if perm:
            got, tok = self.exchange(perm)(out, tok)
            if arrives:
                name = "acts" if arrives == 1 else "grads"
                new = lax.dynamic_update_index_in_dim(st[name], got.astype(st[name].dtype), row["recv_slot"], 0)
                st = {**st, name: new}
        if self.cfg.data_axes and done:
            st, tok = self.average_stages(st, tok)
        return st, tok


_INDICES = ("chunk", "microbatch", *(f"{k}_slot" for k in SLOTS), "recv_slot")  # what varies between repeats


def _rank_column(plan: TickPlan, table: ps.Schedule, rank: int) -> tuple[list[tuple], list[dict]]:
    """Per tick of `rank`'s column: its kind (op code, sendrecv pattern, what arrives, whether the rank's stage
    gradients are then final: the code the tick runs) and its indices (chunk, micro-batch, slots)."""
    kinds = [
        (int(plan.branch[t, rank]), tick.perm(), int(plan.recv_kind[t, rank]), int(plan.done[t, rank]))
        for t, tick in enumerate(table.ticks)
    ]
    indices = [{k: int(getattr(plan, k)[t, rank]) for k in _INDICES} for t in range(len(table.ticks))]
    return kinds, indices


def rank_segments(kinds: list, most_period: int = 8) -> list[tuple[int, int, int]]:
    """`kinds` (one per tick) cut into `(start, period, repeats)` segments covering them in order: the longest
    run of a pattern of up to `most_period` ticks repeated at least twice becomes one segment (a loop);
    the ticks before and after are cut the same way, and what repeats nothing is `(start, 1, 1)` each."""
    best = None
    for period in range(1, min(most_period, len(kinds) // 2) + 1):
        for start in range(len(kinds) - 2 * period + 1):
            repeats = 1
            while kinds[start + repeats * period : start + (repeats + 1) * period] == kinds[start : start + period]:
                repeats += 1
            if repeats >= 2 and (best is None or repeats * period > best[1] * best[2]):
                best = (start, period, repeats)
    if best is None:
        return [(t, 1, 1) for t in range(len(kinds))]
    start, period, repeats = best
    end = start + period * repeats
    before = rank_segments(kinds[:start], most_period)
    after = [(s + end, p, r) for s, p, r in rank_segments(kinds[end:], most_period)]
    return [*before, best, *after]


class ScheduleGrads:
    """The pipeline's per-device program for `jaxdist.engine.step.train_step`:
    `grads(params, model_state, step, batch) -> (gradient pieces, model_state, {"loss"})`.

    Args:
      cfg: the pipeline's options; parts: the engine's parts of the run.
      table, plan: the schedule and its arrays (`tick_plan`, built with the same `keep` and variants);
      placement: the blocks over pp; keep: keep the forward's residuals (else recompute them);
      variant_starts: each stage variant's first block (`stage_ops.stage_variants`);
      rank: this process's pp rank, to trace its column of the table alone (`_Ticks.run_rank`: a
        per-rank program); None traces every rank's program in one (a switch per tick on the rank).
    """

    def __init__(
        self,
        cfg: Options,
        parts: EngineParts,
        table: ps.Schedule,
        plan: TickPlan,
        placement: StagePlacement,
        keep: bool = True,
        variant_starts: tuple[int, ...] = (0,),
        rank: int | None = None,
    ):
        self.cfg, self.parts, self.table, self.plan, self.placement = cfg, parts, table, plan, placement
        self.keep, self.variant_starts, self.rank = keep, variant_starts, rank

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
        # this step's batch may differ in size from prepare's example: the activations' shape follows it
        micro = micro_avals(cfg, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch))
        ticks = _Ticks(self, w, chunks, batch, model_state, micro, self.x_aval(micro))
        if self.rank is None:
            st, tok = ticks.run(ticks.initial(w), rank, self.table, tok)
        else:
            st, tok = ticks.run_rank(ticks.initial(w), self.rank, self.table, tok)

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


def mean_over(tree: dict, axes, tok, backend, pack: bool = True):
    """`tree`'s arrays averaged over `axes`: one all-reduce per dtype (packed into a flat buffer), or with
    `pack=False` one grouped all-reduce over the arrays in place."""
    if not pack:
        keys = sorted(tree)
        if not keys:
            return dict(tree), tok
        means, tok = comm.all_reduce(tuple(tree[k] for k in keys), axes, tok, op="mean", backend=backend)
        return dict(zip(keys, means, strict=True)), tok
    out = dict(tree)
    for keys in by_dtype(sorted(tree), tree):
        flat = jnp.concatenate([tree[k].reshape(-1) for k in keys])
        flat, tok = comm.all_reduce(flat, axes, tok, op="mean", backend=backend)
        offset = 0
        for k in keys:
            out[k] = flat[offset : offset + tree[k].size].reshape(tree[k].shape)
            offset += tree[k].size
    return out, tok
