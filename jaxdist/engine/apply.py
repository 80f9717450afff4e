"""The units' code as functions of their parameter pieces: the embed, each block and the head run
on the model's own modules, with the plan's parallel layers bound in place of the matched ones, and
the gradient sums over tp that replicated parameters need decided once, at prepare.

`UnitCode` is built from the `ModelSplit` and the `Layout`; the step (`jaxdist.engine.step`) and the
pipeline's schedule call its `embed`, `block` and `head`.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxdist import cp
from jaxdist.compat import model_sharding_dropped
from jaxdist.core.model_state import drop_intermediates
from jaxdist.engine.layout import Layout, piece_shape, whole_shape
from jaxdist.engine.options import Options
from jaxdist.engine.units import ModelSplit, call_block
from jaxdist.tp import layers as tp_math
from jaxdist.tp.bind import Binding, bind
from jaxdist.tp.grads import tp_summed
from jaxdist.tp.plan import ResolvedPlan


def block_leaf_groups(split: ModelSplit, layout: Layout) -> list[list[int]]:
    """Per block, the indices of its leaves (for stacked layers, the stacked leaves, for every layer)."""
    units, leaves = split.units, layout.leaves
    if units.stacked:
        stacked = [k for k, leaf in enumerate(leaves) if leaf.path[0] == units.blocks]
        groups = [stacked] * split.n_blocks
    else:
        groups = [
            [k for k, leaf in enumerate(leaves) if leaf.path[:2] == (units.blocks, i)] for i in range(split.n_blocks)
        ]
    if split.n_blocks == 0:
        raise ValueError(f"Parallel: the model's {units.blocks!r} holds no blocks; units need at least one")
    for i in range(split.n_blocks if not units.stacked else 0):
        if split.block_trees[i].num_leaves != len(groups[i]):
            raise ValueError(
                f"Parallel: block {i} shares parameters with another part of the model; every block must own "
                "its parameters (a tied weight belongs to the embed and head units)"
            )
    return groups


def sequence_dim_of(cfg: Options, shape: tuple[int, ...]) -> int:
    """The activations' dimension sequence parallelism splits over tp (1 when it is off: unused)."""
    if not cfg.sequence_parallel:
        return 1
    if cfg.sequence_dim is None:
        dim = 0 if shape and shape[0] % cfg.tp == 0 else 1
    else:
        dim = cfg.sequence_dim
    if not 0 <= dim < len(shape) - 1 or shape[dim] % cfg.tp:
        raise ValueError(
            f"Parallel: sequence_parallel splits dimension {dim} of the activations {shape} over tp={cfg.tp}; "
            "it must be a token dimension (not the last, the features) that tp divides: change the batch or "
            "sequence length, pass sequence_dim, or turn sequence_parallel off"
        )
    return dim


class UnitCode:
    """The units of `split` as functions of parameter pieces `{leaf index: array}`.

    Args:
      cfg, mesh: the engine's options and the mesh it computes on.
      split, layout: the model's units and its parameters' leaves.
      placements: the resolved TP plan (None without tp).
      block_leaves: per block, its leaves (`block_leaf_groups`).
      local_batch: one data rank's batch avals (prepare's example); under cp, the whole sequence (the
        attribute then holds one cp rank's chunks: what the per-device program sees).

    Attributes:
      embed_leaves, head_leaves, tied: the outer leaves the embed reads, those the head reads (and
        the outer ones nothing reads), and those both read (a tied embedding).
      sequence_dim: the activations' dimension sequence parallelism splits.
      aux_specs: the out spec of each of `head_loss`'s aux leaves (None without aux).
      tp_sums: per unit ("embed", "head", block i), the replicated leaves whose gradient is summed over tp.
      cp_length: under cp, the whole sequence's length (None without cp).
    """

    def __init__(
        self,
        cfg: Options,
        mesh,
        split: ModelSplit,
        layout: Layout,
        placements: ResolvedPlan | None,
        block_leaves: list[list[int]],
        local_batch,
    ):
        self.cfg, self.mesh, self.split, self.layout = cfg, mesh, split, layout
        self.units, self.placements = split.units, placements
        self.block_leaves, self.local_batch = block_leaves, local_batch
        self.trace_backend: str | None = None  # "xla" while `_decide_tp_sums` traces
        self.tp_sums: dict = {}
        leaves = layout.leaves
        outer = [k for k, leaf in enumerate(leaves) if not split.is_block_path(leaf.path)]
        x_aval = jax.eval_shape(self.embed_shape, layout.avals(outer, whole=True), local_batch)
        self.cp_length = None
        if cfg.cp > 1:  # context parallelism: from here on, one cp rank's chunks of the sequence
            x_aval = self._cp_prepare(x_aval, outer)
        self.sequence_dim = sequence_dim_of(cfg, x_aval.shape)
        head = self._head_as_on_one_device(x_aval)
        self.aux_specs = self._aux_specs(jax.eval_shape(head, layout.avals(outer, whole=True), self.local_batch))
        everything = range(len(leaves))
        read_by_embed = self.reads(self.embed_shape, everything)
        read_by_head = self.reads(head, everything)
        self._check_outer_reads(read_by_embed - set(outer), "embed")
        self._check_outer_reads(read_by_head - set(outer), "head_loss")
        self.embed_leaves = [k for k in outer if k in read_by_embed]
        self.head_leaves = [k for k in outer if k in read_by_head or k not in read_by_embed]
        self.tied = [k for k in self.embed_leaves if k in self.head_leaves]
        # under cp the blocks' attention traced on one rank's shapes: the whole context's keys (jaxdist.cp)
        with cp.probe_attention(cfg.cp, self.cp_length) if cfg.cp > 1 else contextlib.nullcontext():
            self.tp_sums = self._decide_tp_sums(x_aval) if cfg.tp > 1 else {}

    def _cp_prepare(self, x_whole, outer):
        """Context parallelism at prepare: the sequence length, one cp rank's batch avals (`local_batch`
        from here on), the model checked to run correctly on them (`jaxdist.cp.check_model`); returns the
        activations' aval on one cp rank."""
        cfg, split, units, who = self.cfg, self.split, self.units, type(self.cfg).__name__
        self.cp_length = cp.sequence_length(self.local_batch, x_whole.shape, who)
        self.cp_batch_dims = cp.sequence_dims(self.local_batch)  # each step's batch must have them too
        self.local_batch = cp.local_batch_avals(self.local_batch, cfg.cp, self.cp_length, cfg.cp_whole, who)
        x_aval = jax.eval_shape(self.embed_shape, self.layout.avals(outer, whole=True), self.local_batch)
        if x_aval.shape[1] != 2 * cp.chunk_len(cfg.cp, self.cp_length):
            raise ValueError(
                f"{who}: under cp the embed made activations {x_aval.shape} of one rank's batch; cp cuts every batch "
                f"array whose dimension 1 has the sequence length {self.cp_length}: give inputs and targets that "
                "length (for jaxdist's GPT: jaxdist.models.gpt.next_token_batch)"
            )

        @model_sharding_dropped()
        def run_model(params, batch):  # the model as on one device, as the plan's trace runs it
            # the variables made anew inside the trace: the model's RNG counts and batch statistics change in it
            model = nnx.merge(split.graphdef, params, jax.tree.map(lambda v: v, split.rest))
            x = units.embed(model, batch)
            for i in range(1 if units.stacked else split.n_blocks):
                block = split.first_layer if units.stacked else getattr(model, units.blocks)[i]
                x = call_block(i, block, x, batch, units.block_call)
            units.head_loss(model, x, batch)
            return jnp.zeros(())

        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), nnx.to_pure_dict(split.template))
        cp.check_model(run_model, shapes, self.local_batch, cfg.cp, self.cp_length, who)
        return x_aval

    # -- shapes and reads, as on one device -------------------------------------------------

    def embed_shape(self, ws, batch):
        """The embed's activations on whole outer parameters `ws`, unbound (for shapes and reads)."""
        start = self.split.initial_model_state["outer"]

        def embed(model):
            return self.units.embed(model, batch)

        return self.outer_apply(ws, start, embed, bound=False)[0]

    def _head_as_on_one_device(self, x_aval):
        start = self.split.initial_model_state["outer"]

        def head(ws, batch):
            def head_loss(model):
                return self.units.head_loss(model, jnp.zeros(x_aval.shape, x_aval.dtype), batch)

            return self.outer_apply(ws, start, head_loss, bound=False)[0]

        return head

    def reads(self, fn, indices) -> set[int]:
        """The leaves among `indices` that `fn(pieces, batch)` reads."""
        jaxpr = jax.make_jaxpr(fn)(self.layout.avals(indices, whole=True), self.local_batch).jaxpr
        used = {v for eqn in jaxpr.eqns for v in eqn.invars if isinstance(v, jax.extend.core.Var)}
        used |= {v for v in jaxpr.outvars if isinstance(v, jax.extend.core.Var)}
        order = sorted(indices)  # dict pytrees flatten in key order
        return {k for k, v in zip(order, jaxpr.invars[: len(order)], strict=True) if v in used}

    def _check_outer_reads(self, block_reads: set[int], unit: str) -> None:
        """The embed and head units run on the outer parameters only (a block's parameters are gathered for
        its own unit): one that reads a block's parameters would compute with zeros in their place."""
        if block_reads:
            names = ", ".join(self.layout.leaves[k].name for k in sorted(block_reads)[:3])
            names += " ..." if len(block_reads) > 3 else ""
            raise ValueError(
                f"Parallel: Units.{unit} reads parameters of the blocks ({names}); "
                "the embed and head units see only the parameters outside the blocks. Run that module as a block "
                "(or give the embed / head a module of its own), or use DDP, which has no units"
            )

    def _aux_specs(self, out_aval):
        """Check `head_loss`'s output against the units' flags; the out spec of each aux leaf."""
        units = self.units
        loss = out_aval
        if units.has_aux:
            if not (isinstance(out_aval, tuple) and len(out_aval) == 2):
                raise ValueError("Parallel: Units(has_aux=True) needs head_loss to return (loss, aux)")
            loss, aux = out_aval
        if units.sum_and_count:
            ok = isinstance(loss, tuple) and len(loss) == 2 and all(x.shape == () for x in loss)
            if not ok:
                raise ValueError(
                    "Parallel: Units(sum_and_count=True) needs head_loss's loss to be (sum, count) scalars"
                )
        elif not (hasattr(loss, "shape") and loss.shape == ()):
            flag = "; pass Units(has_aux=True) or Units(sum_and_count=True)" if isinstance(loss, tuple) else ""
            raise ValueError(f"Parallel: head_loss must return a scalar loss{flag}, got {loss}")
        if not units.has_aux:
            return None
        rows = jax.tree.leaves(self.local_batch)[0].shape[0]
        per_example = [a for a in jax.tree.leaves(aux) if a.ndim and a.shape[0] == rows]
        specs = jax.tree.map(lambda a: self.cfg.batch_spec if a.ndim and a.shape[0] == rows else P(), aux)
        if self.cfg.cp > 1 and per_example:  # (whatever the data axes: with cp alone the batch spec is P())
            raise ValueError(
                "Parallel: under cp each rank's per-example aux values cover only its tokens; return scalar aux "
                "values (averaged over the ranks) or leave cp out"
            )
        return specs

    # -- the plan bound, and the gradient sums over tp -----------------------------------------

    def binding(self) -> Binding:
        cfg = self.cfg
        backend = self.trace_backend or cfg.backend
        return Binding(cfg.tp_axis, cfg.tp, backend, cfg.sequence_parallel, self.sequence_dim)

    def bound(self, module, prefix=()):
        """`module` with the plan's parallel layers bound in place of the matched ones."""
        if self.placements is not None:
            bind(module, self.placements, self.binding(), prefix)
        return module

    @model_sharding_dropped()  # the units' code on one rank's shapes: the model's own sharding annotations are no-ops
    def _decide_tp_sums(self, x_aval) -> dict:
        """Per unit ("embed", "head", block i), the replicated parameters whose gradient is summed over
        tp: those acting on values that differ per tp rank (`jaxdist.tp.grads`, from JAX's types)."""
        cfg, units, state = self.cfg, self.units, self.split.initial_model_state
        leaves = self.layout.leaves
        shape = list(x_aval.shape)
        if cfg.sequence_parallel:
            shape[self.sequence_dim] //= cfg.tp
        x = jax.ShapeDtypeStruct(tuple(shape), x_aval.dtype)
        names = {k: leaf.name for k, leaf in enumerate(leaves)}

        def decide(unit, ks, x, stored, who, *, layer=False, out_may_vary=False):
            skip = 1 if layer else 0  # one layer of a stacked leaf
            ws = {k: jax.ShapeDtypeStruct(leaves[k].local[skip:], leaves[k].dtype) for k in ks}
            split = frozenset(k for k in ks if leaves[k].tp_dim is not None)
            return tp_summed(
                unit,
                ws,
                x,
                (self.local_batch, stored),
                mesh=self.mesh,
                axis=cfg.tp_axis,
                split=split,
                x_varies=cfg.sequence_parallel,
                out_may_vary=out_may_vary,
                names=names,
                who=who,
            )

        def embed(ws, _, inputs):
            batch, stored = inputs

            def embed_loss(model):
                return units.embed(model, batch)

            return self.outer_apply(ws, stored, embed_loss)[0]

        def head(ws, x, inputs):
            return self.head(ws, x, *inputs, summed=False)[0]

        def block_of(i):
            def block(ws, x, inputs):
                return self.block(i, ws, x, *inputs, summed=False)[0]

            return block

        self.trace_backend = "xla"  # the type trace is never compiled; jax.lax collectives carry the types
        try:
            sums = {
                "embed": decide(embed, self.embed_leaves, None, state["outer"], "the embed"),
                "head": decide(head, self.head_leaves, x, state["outer"], "the head"),
            }
            seen = {}  # blocks of one definition and piece shapes run one program: trace it once
            for i in range(self.split.n_blocks):
                ks = self.block_leaves[i]
                same = (self.split.block_kinds[i], tuple((leaves[k].local, leaves[k].tp_dim) for k in ks))
                if same not in seen:
                    stored = state["blocks"][i] if self.split.block_states is not None else None
                    summed = decide(
                        block_of(i),
                        ks,
                        x,
                        stored,
                        f"block {i}",
                        layer=units.stacked,
                        out_may_vary=cfg.sequence_parallel,
                    )
                    seen[same] = (ks, summed)
                first, summed = seen[same]
                sums[i] = frozenset(k for k, k0 in zip(ks, first, strict=True) if k0 in summed)
        finally:
            self.trace_backend = None
        return sums

    def summed(self, ws: dict, unit) -> dict:
        """The unit's pieces, those of `tp_sums[unit]` with their gradient summed over tp in backward."""
        summed = self.tp_sums.get(unit, ())
        cfg = self.cfg
        return {k: tp_math.copy_to_tp(w, cfg.tp_axis, cfg.backend) if k in summed else w for k, w in ws.items()}

    # -- the units on their pieces ----------------------------------------------------------

    @model_sharding_dropped()
    def outer_apply(self, ws: dict, stored, fn, bound: bool = True, unread: str | None = None):
        """`fn(model)` on the model holding the given outer pieces, zeros elsewhere (never read; XLA
        drops them) and the outer variables `stored`; returns `(out, the outer variables after)`.
        `bound=False` (tracing outside the mesh, for shapes and reads) takes whole parameters and
        leaves the layers unbound: the model as on one device."""
        shape = piece_shape if bound else whole_shape
        leaves = self.layout.leaves
        xs = [ws[k] if k in ws else jnp.zeros(shape(leaf), leaf.dtype) for k, leaf in enumerate(leaves)]

        def run(model):
            return fn(self.bound(model) if bound else model)

        split = self.split
        unflat = self.layout.unflatten(xs)
        return split.outer_state.apply(split.graphdef, unflat, stored, run, fixed=split.blocks_fixed, unread=unread)

    def embed(self, ws, batch, stored):
        """The embed on its pieces and the outer variables `stored`: `(x, the outer variables after)`
        (under sequence parallelism x is this tp rank's chunk)."""

        def embed(model):
            return self.units.embed(model, batch)

        x, after = self.outer_apply(self.summed(ws, "embed"), stored, embed, unread="the embed")
        if self.cfg.sequence_parallel:
            x = tp_math.split_sequence(x, self.cfg.tp_axis, self.cfg.backend, self.sequence_dim)
        return x, after

    def head(self, ws, x, batch, stored, summed: bool = True):
        """`(total, (count or None, aux or None, the outer variables after))` of the head's loss;
        `summed=False` leaves out the gradient sums over tp (`summed`)."""
        units = self.units
        ws = self.summed(ws, "head") if summed else ws

        def head_loss(model):
            return units.head_loss(model, x, batch)

        out, after = self.outer_apply(ws, stored, head_loss)
        loss, aux = out if units.has_aux else (out, None)
        total, count = loss if units.sum_and_count else (loss, None)
        return total, (count, aux, after)

    @model_sharding_dropped()
    def block(self, i: int, ws: dict, x, batch, stored, summed: bool = True):
        """Block i on its pieces and its variables `stored`: `(y, its variables after)`."""
        split = self.split
        ws = self.summed(ws, i) if summed else ws
        pure = split.block_trees[i].unflatten([ws[k] for k in self.block_leaves[i]])

        def run(block):
            return call_block(i, self.bound(block, split.block_prefix(i)), x, batch, self.units.block_call)

        unread = "a block"
        if split.block_states is None:
            block = nnx.merge(split.block_defs[i], pure, split.block_rests[i])
            y = run(block)
            drop_intermediates(block, unread)
            return y, None
        return split.block_states[i].apply(split.block_defs[i], pure, stored, run, unread=unread)
