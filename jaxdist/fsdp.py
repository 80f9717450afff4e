"""FSDP (ZeRO-3) with double buffering: parameters sharded per unit, gathered just ahead of use.

A unit is one repeated block of the model (an element of `model.blocks`); the
parts before and after the blocks (embedding; final norm and head) are units
of their own. Each unit's parameters live as one flat vector sharded over the
`fsdp` mesh axis (padded to divide evenly), together with the optimizer state
of that shard.

Forward gathers unit i+1 while unit i computes and drops gathered weights
after use (unless `reshard_after_forward=False`); backward re-gathers unit
i-1 while unit i computes its gradients, and reduce-scatters unit i's
gradients while unit i-1 runs. Both loops are `jaxdist._pipeline.pipelined_loop`,
whose carry holds exactly `buffers - 1` in-flight units: a third gathered
unit, or a gradient buffer reused while its reduce-scatter is pending, cannot
be written. With `update_in_backward=True` each unit's shard is updated as soon
as its reduce-scatter finishes, so the sharded gradients of all units never
exist at once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist import comm
from jaxdist._pipeline import AsyncOp, check_buffers, kept, pipelined_loop
from jaxdist._step import TrainState, local_batch_avals, sharded_step
from jaxdist.buckets import Bucket, bucket_layout, pack_bucket, param_name, unpack_bucket
from jaxdist.engine import Units
from jaxdist.model_state import ModelState, check_identical_blocks, keep_if, training_copy


@dataclasses.dataclass(frozen=True)
class FSDP:
    """Options of fully sharded data parallelism over the mesh axis `axis`.

    Attributes:
      mesh: the device mesh.
      axis: the mesh axis parameters are sharded over.
      dp_axis: an optional replica axis (HSDP): parameters are replicated over
        it, the batch is split over both axes, and gradient shards are averaged
        over it after the reduce-scatter.
      buffers: how many gathered units may exist at once (>= 2).
      prefetch: how many units ahead gathers start; needs `prefetch + 1 <= buffers`.
      reshard_after_forward: drop gathered weights after the forward (re-gather
        in backward); False keeps every unit's gathered weights for backward.
      compute_dtype: dtype parameters are gathered and computed in (e.g.
        bfloat16); master shards keep the model's parameter dtype.
      reduce_dtype: dtype gradients are reduce-scattered in (default: the
        master dtype).
      update_in_backward: update each unit's shard as soon as its gradients
        are reduce-scattered. Excludes `max_grad_norm` and `skip_nonfinite`
        (both need every gradient before any update); the optimizer must treat
        units independently (elementwise transformations do).
      max_grad_norm: clip by the global gradient norm.
      skip_nonfinite: skip the update when a gradient is NaN/Inf (default:
        on, unless `update_in_backward`).
      unroll: unroll the unit loops instead of using `lax.scan` (always so with
        the nccl backend, whose in-flight buffers must not be loop carries).
      backend: the `jaxdist.comm` backend.
    """

    mesh: jax.sharding.Mesh
    axis: str = "fsdp"
    dp_axis: str | None = None
    buffers: int = 2
    prefetch: int = 1
    reshard_after_forward: bool = True
    compute_dtype: Any = None
    reduce_dtype: Any = None
    update_in_backward: bool = False
    max_grad_norm: float | None = None
    skip_nonfinite: bool | None = None
    unroll: bool = False
    backend: str | None = None

    def __post_init__(self):
        for name in (self.axis, self.dp_axis):
            if name is not None and name not in self.mesh.axis_names:
                raise ValueError(f"FSDP: axis {name!r} is not a mesh axis; the mesh has {self.mesh.axis_names}")
        check_buffers("FSDP", self.buffers, self.prefetch)
        if self.update_in_backward and self.max_grad_norm is not None:
            raise ValueError(
                "FSDP: update_in_backward updates each unit before the global gradient norm exists, so it cannot "
                "clip by it; drop max_grad_norm or set update_in_backward=False"
            )
        if self.update_in_backward and self.skip_nonfinite:
            raise ValueError(
                "FSDP: update_in_backward updates units before every gradient is known, so it cannot skip a step "
                "with a NaN/Inf gradient; pass skip_nonfinite=False or set update_in_backward=False"
            )

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis]

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return (self.dp_axis, self.axis) if self.dp_axis else (self.axis,)

    def prepare(self, model: nnx.Module, optimizer: optax.GradientTransformation, units: Units, batch) -> FSDPRun:
        """Shard `model`'s parameters per unit and build the train step.

        Args:
          model: a Flax NNX module with identical blocks in `getattr(model, units.blocks)`
            (one static definition and parameter shapes; their constants and
            other variables may differ: each block keeps its own). The step
            runs it in train mode; its non-parameter variables (dropout RNG
            streams, batch statistics) are the train state's `model_state`,
            see `jaxdist.model_state`.
          optimizer: an elementwise optax transformation (it sees each unit's
            flat shard as one leaf; the blocks' states are stacked with vmap).
          units: how the model splits into units (`jaxdist.engine.Units` in its plain form:
            `block(x)` blocks in a list and a mean loss; the unit engine takes the others).
          batch: an example global batch; leading dimensions are split over
            the batch axes.
        """
        extras = [f for f in ("block_call", "stacked", "has_aux", "sum_and_count") if getattr(units, f)]
        if extras:
            raise ValueError(
                f"FSDP: units with {', '.join(extras)} need the unit engine: use "
                "jaxdist.engine.Parallel(mesh) over an 'fsdp' axis, the same ZeRO-3 storage"
            )
        return FSDPRun(self, model, optimizer, units, batch)


def _single_bucket(tree, size: int, what: str) -> Bucket:
    layout = bucket_layout(tree, size, bucket_size=None)
    if len(layout) != 1:
        dtypes = sorted({b.dtype.name for b in layout.buckets})
        raise ValueError(f"FSDP: the parameters of {what} mix dtypes {dtypes}; a unit must have one parameter dtype")
    return layout.buckets[0]


class FSDPRun:
    """A prepared FSDP run: `state`, `step(state, batch) -> (state, metrics)`, `model(state)`."""

    def __init__(self, cfg: FSDP, model, optimizer, units: Units, batch):
        self.cfg, self.optimizer, self.units = cfg, optimizer, units
        model = training_copy(model)
        blocks = getattr(model, units.blocks, None)
        if blocks is None or len(blocks) == 0:
            raise ValueError(f"FSDP: model.{units.blocks} must be a non-empty list of identical blocks")
        self.n_blocks = len(blocks)
        check_identical_blocks(blocks, "FSDP")
        self.graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        self.block_graph, block0, block0_rest = nnx.split(blocks[0], nnx.Param, ...)
        self.block_treedef = jax.tree.structure(block0)
        block_params, block_rests = zip(*(nnx.split(b, nnx.Param, ...)[1:] for b in blocks), strict=True)
        for i, (bp, br) in enumerate(zip(block_params, block_rests, strict=True)):
            if not _same_arrays(bp, block0) or not _same_arrays(br, block0_rest):
                raise ValueError(
                    f"FSDP: block {i} has other parameter or variable shapes than block 0; every block must "
                    "have the same"
                )
        self.block_bucket = _single_bucket(block0, cfg.size, "a block")

        # non-parameter variables: each block's own, stacked like its parameters; the rest of the model's
        self.block_state = ModelState(block0_rest)
        in_model = rest.get(units.blocks, nnx.State({}))
        own, in_place = nnx.to_pure_dict(block0_rest), nnx.to_pure_dict(in_model)
        for i in range(self.n_blocks):
            if not _same_arrays(in_place.get(i, {}), own):
                raise ValueError(
                    f"FSDP: block {i} shares non-parameter variables with another part of the model; every block "
                    "must own its variables (give each block its own, e.g. its own dropout RNG stream)"
                )
        self.blocks_rest = {units.blocks: in_model} if units.blocks in rest else {}  # completes the outer model
        outer_rest = nnx.State({k: v for k, v in rest.items() if k != units.blocks})
        self.outer_state = ModelState(outer_rest)
        model_state = {
            "outer": self.outer_state.store(outer_rest),
            "blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *map(self.block_state.store, block_rests)),
        }

        # the parameters outside the blocks, split by which end of the model reads them
        paths, self.treedef = jax.tree_util.tree_flatten_with_path(params)
        names = [param_name(p) for p, _ in paths]
        prefix = f"{units.blocks}/"
        self.outer = [i for i, n in enumerate(names) if not n.startswith(prefix)]
        self.block_leaf = {
            i: (int(n[len(prefix) :].split("/")[0]), n) for i, n in enumerate(names) if n.startswith(prefix)
        }
        leaves = [x for _, x in paths]
        self.leaf_avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
        self.local_batch = self._local_batch(batch)
        outer = model_state["outer"]
        embed = lambda ls, b: self._apply_outer(ls, outer, lambda m: units.embed(m, b))[0]
        x_aval = jax.eval_shape(embed, self._outer_avals(), self.local_batch)
        zeros_x = lambda: jnp.zeros(x_aval.shape, x_aval.dtype)
        head = lambda ls, b: self._apply_outer(ls, outer, lambda m: units.head_loss(m, zeros_x(), b))[0]
        read_by_embed = self._reads(embed, self.local_batch)
        read_by_head = self._reads(head, self.local_batch)
        self.embed_leaves = [i for i in self.outer if i in read_by_embed]
        self.head_leaves = [i for i in self.outer if i not in read_by_embed]
        self.tied = [i for i in self.embed_leaves if i in read_by_head]
        if not self.embed_leaves or not self.head_leaves:
            raise ValueError("FSDP: the embed and head units each need parameters of their own")
        self.embed_bucket = _single_bucket([leaves[i] for i in self.embed_leaves], cfg.size, "the embed unit")
        self.head_bucket = _single_bucket([leaves[i] for i in self.head_leaves], cfg.size, "the head unit")
        self.names = names
        self.fused = cfg.update_in_backward
        self.state = self._init_state(leaves, block_params, model_state)
        self.step = jax.jit(self._step, donate_argnums=0)

    # -- units as functions of flat weights -------------------------------------

    def _outer_avals(self):
        return [self.leaf_avals[i] for i in self.outer]

    def _apply_outer(self, outer_leaves, outer_stored, fn):
        """`fn(model)` on the model with the given outer parameters and zeros for the blocks' (never read;
        XLA drops them); returns `(out, outer model state after fn)`."""
        full = [None] * len(self.leaf_avals)
        for i, x in zip(self.outer, outer_leaves, strict=True):
            full[i] = x
        for i in self.block_leaf:
            full[i] = jnp.zeros(self.leaf_avals[i].shape, self.leaf_avals[i].dtype)
        params = self.treedef.unflatten(full)
        return self.outer_state.apply(self.graphdef, params, outer_stored, fn, fixed=self.blocks_rest)

    def _reads(self, fn, batch) -> set[int]:
        """The outer leaves (by full index) that `fn(outer_leaves, batch)` reads."""
        jaxpr = jax.make_jaxpr(fn)(self._outer_avals(), batch).jaxpr
        used = {v for eqn in jaxpr.eqns for v in eqn.invars if isinstance(v, jax.extend.core.Var)}
        used |= {v for v in jaxpr.outvars if isinstance(v, jax.extend.core.Var)}
        return {i for i, v in zip(self.outer, jaxpr.invars[: len(self.outer)], strict=True) if v in used}

    def _outer_leaves(self, embed_flat, head_flat):
        leaves = {}
        if embed_flat is not None:
            el = unpack_bucket(self.embed_bucket, embed_flat, embed_flat.dtype)
            leaves.update({self.embed_leaves[k]: v for k, v in el.items()})
        if head_flat is not None:
            hl = unpack_bucket(self.head_bucket, head_flat, head_flat.dtype)
            leaves.update({self.head_leaves[k]: v for k, v in hl.items()})
        return [leaves.get(i, jnp.zeros(self.leaf_avals[i].shape, self.leaf_avals[i].dtype)) for i in self.outer]

    def _embed(self, embed_flat, outer_stored, batch):
        """`(x, outer model state after the embed)`."""
        fn = lambda model: self.units.embed(model, batch)
        return self._apply_outer(self._outer_leaves(embed_flat, None), outer_stored, fn)

    def _head(self, head_flat, embed_flat, x, outer_stored, batch):
        """`(loss, outer model state after the head)`."""
        fn = lambda model: self.units.head_loss(model, x, batch)
        return self._apply_outer(self._outer_leaves(embed_flat, head_flat), outer_stored, fn)

    def _block(self, w_flat, stored, x):
        """`(y, the block's model state after it ran)`."""
        params = unpack_bucket(self.block_bucket, w_flat, w_flat.dtype)
        tree = self.block_treedef.unflatten([params[i] for i in range(len(params))])
        return self.block_state.apply(self.block_graph, tree, stored, lambda block: block(x))

    # -- state -------------------------------------------------------------------

    def _local_batch(self, batch):
        n = int(np.prod([self.cfg.mesh.shape[a] for a in self.cfg.batch_axes]))
        fix = f"the {n} devices of the batch axes {self.cfg.batch_axes}; change the batch size"
        return local_batch_avals(batch, n, "FSDP", fix)

    def _specs(self):
        a = self.cfg.axis
        return {"embed": P(a), "head": P(a), "blocks": P(None, None, a) if self.fused else P(None, a)}

    def _opt_specs(self, params):
        shapes = jax.eval_shape(self._opt_init, params)
        a = self.cfg.axis
        # sharded: a unit's flat (S,) leaf, or the blocks' stacked (L, S) one; everything else replicated
        unit_spec = lambda s: P(a) if s.ndim == 1 else P()
        stacked_spec = lambda s: P(None, a) if s.ndim == 2 else P()
        return {
            "embed": jax.tree.map(unit_spec, shapes["embed"]),
            "head": jax.tree.map(unit_spec, shapes["head"]),
            "blocks": jax.tree.map(stacked_spec, shapes["blocks"]),
        }

    def _opt_init(self, params):
        blocks = params["blocks"][:, 0] if self.fused else params["blocks"]
        block_opt = jax.vmap(self.optimizer.init)(blocks)
        return {
            "embed": self.optimizer.init(params["embed"]),
            "head": self.optimizer.init(params["head"]),
            "blocks": self._fuse(blocks, block_opt)[1] if self.fused else block_opt,
        }

    # -- update_in_backward keeps each unit's parameters and elementwise optimizer state in one array ----
    # (L, 1 + m, S): row 0 the parameter shard, rows 1..m the optimizer leaves shaped like it (Adam's mu
    # and nu). One in-place write per unit then updates all of them; with separate buffers XLA fuses the
    # update math into each write and has to copy whole buffers to keep the old state readable.

    def _block_opt_layout(self):
        aval = jax.ShapeDtypeStruct((self.n_blocks, self.block_bucket.size), self.block_bucket.dtype)
        shapes = jax.eval_shape(jax.vmap(self.optimizer.init), aval)
        leaves, treedef = jax.tree.flatten(shapes)
        rows = [x.shape == aval.shape and x.dtype == aval.dtype for x in leaves]
        return treedef, rows

    def _fuse(self, blocks, block_opt):
        """(L, S) parameters and their stacked optimizer state -> the (L, 1 + m, S) array and the other leaves."""
        _, rows = self._block_opt_layout()
        leaves = jax.tree.leaves(block_opt)
        fused = jnp.stack([blocks, *(x for x, r in zip(leaves, rows, strict=True) if r)], axis=1)
        return fused, tuple(x for x, r in zip(leaves, rows, strict=True) if not r)

    def _unfuse_unit(self, unit_rows, others):
        """One unit's (1 + m, S) rows and other leaves -> its parameter shard and optimizer state."""
        treedef, rows = self._block_opt_layout()
        fused_rows, other_leaves = iter(range(1, unit_rows.shape[0])), iter(others)
        leaves = [unit_rows[next(fused_rows)] if r else next(other_leaves) for r in rows]
        return unit_rows[0], treedef.unflatten(leaves)

    def _unit_weights(self, blocks, unit):
        """Unit `unit`'s parameter shard from the stacked block storage."""
        return _index(_index(blocks, unit), 0) if self.fused else _index(blocks, unit)

    def _sharding(self, spec):
        return NamedSharding(self.cfg.mesh, spec)

    def _init_state(self, leaves, block_params, model_state) -> TrainState:
        specs = self._specs()
        shardings = {k: self._sharding(v) for k, v in specs.items()}

        def pack_all(leaves, block_params):
            return {
                "embed": pack_bucket(self.embed_bucket, [leaves[i] for i in self.embed_leaves]),
                "head": pack_bucket(self.head_bucket, [leaves[i] for i in self.head_leaves]),
                "blocks": jnp.stack([pack_bucket(self.block_bucket, jax.tree.leaves(bp)) for bp in block_params]),
            }

        params = jax.jit(pack_all, out_shardings={**shardings, "blocks": self._sharding(P(None, self.cfg.axis))})(
            leaves, block_params
        )
        if self.fused:  # parameters plus zero rows for the elementwise optimizer leaves, filled by init below
            fuse = lambda b: self._fuse(b, jax.vmap(self.optimizer.init)(b))[0]
            params["blocks"] = jax.jit(fuse, out_shardings=shardings["blocks"])(params["blocks"])
        opt_shardings = jax.tree.map(self._sharding, self._opt_specs(params), is_leaf=lambda x: isinstance(x, P))
        opt_state = jax.jit(self._opt_init, out_shardings=opt_shardings)(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), self._sharding(P()))
        return TrainState(params, opt_state, step, jax.device_put(model_state, self._sharding(P())))

    def params(self, state: TrainState):
        """The full parameters (an `nnx.State`) of `state`."""
        full = jax.device_put(state.params, self._sharding(P()))
        leaves = [None] * len(self.leaf_avals)
        for k, v in unpack_bucket(self.embed_bucket, full["embed"]).items():
            leaves[self.embed_leaves[k]] = v
        for k, v in unpack_bucket(self.head_bucket, full["head"]).items():
            leaves[self.head_leaves[k]] = v
        blocks = full["blocks"][:, 0] if self.fused else full["blocks"]
        per_block = [unpack_bucket(self.block_bucket, blocks[b]) for b in range(self.n_blocks)]
        block_names = [param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(self._block_names_tree())[0]]
        for i, (b, name) in self.block_leaf.items():
            leaves[i] = per_block[b][block_names.index(name.split("/", 2)[2])]
        return self.treedef.unflatten(leaves)

    def _block_names_tree(self):
        return self.block_treedef.unflatten(list(range(self.block_treedef.num_leaves)))

    def model(self, state: TrainState) -> nnx.Module:
        """An NNX model (in train mode; call `.eval()` for inference) holding the parameters and the
        model state (e.g. running statistics) of `state`."""
        stored = jax.device_put(state.model_state, self._sharding(P()))
        rest = dict(self.outer_state.load(stored["outer"]))
        if self.blocks_rest:
            blocks = self.blocks_rest[self.units.blocks]
            rest[self.units.blocks] = {
                i: self.block_state.load(jax.tree.map(lambda x, i=i: x[i], stored["blocks"])) for i in blocks
            }
        return nnx.merge(self.graphdef, self.params(state), nnx.State(rest))

    # -- the step ----------------------------------------------------------------

    def _step(self, state: TrainState, batch):
        return sharded_step(
            self._local_step,
            self.cfg.mesh,
            state,
            batch,
            param_specs=self._specs(),
            opt_specs=self._opt_specs(state.params),
            batch_spec=P(self.cfg.batch_axes),
            metrics=("loss", "grad_norm", "skipped"),
        )

    def _ops(self):
        cfg = self.cfg
        cdt = cfg.compute_dtype
        rdt = cfg.reduce_dtype

        def gather_start(x, tok):
            return comm.all_gather_start(x if cdt is None else x.astype(cdt), cfg.axis, tok, backend=cfg.backend)

        def scatter_start(g, tok):
            g = g if rdt is None else g.astype(rdt)
            return comm.reduce_scatter_start(g, cfg.axis, tok, op="mean", backend=cfg.backend)

        loops = comm.get_backend(cfg.backend).handles_cross_loops
        return (
            AsyncOp(gather_start, comm.wait, "fsdp.gather", loops),
            AsyncOp(scatter_start, comm.wait, "fsdp.scatter", loops),
        )

    def _gather(self, x, tok):
        h, tok = self._ops()[0].start(x, tok)
        return comm.wait(h, tok)

    def _finish_grad(self, g, tok, dtype):
        """A reduce-scattered gradient shard: averaged over the replica axis (HSDP), in the master dtype."""
        if self.cfg.dp_axis:
            g, tok = comm.all_reduce(g, self.cfg.dp_axis, tok, op="mean", backend=self.cfg.backend)
        return g.astype(dtype), tok

    def _local_step(self, params, opt_state, model_state, step, batch):
        cfg = self.cfg
        gather, scatter = self._ops()
        blocks = params["blocks"]
        master = blocks.dtype
        tok = comm.token()
        rank = jax.lax.axis_index(cfg.batch_axes)
        outer_in = self.outer_state.for_step(model_state["outer"], rank, step)

        def block_in(unit):  # a block's model state at the start of the step, for forward and its replay
            own = jax.tree.map(lambda x: _index(x, unit), model_state["blocks"])
            return self.block_state.for_step(own, rank, step)

        # forward
        embed_w, tok = self._gather(params["embed"], tok)
        x0, outer_mid = self._embed(embed_w, outer_in, batch)
        del embed_w  # re-gathered for backward

        def forward(unit, w, x):
            y, block_out = self._block(w, block_in(unit), x)
            return y, None, (x, None if cfg.reshard_after_forward else w, block_out)

        xl, tok, _, (saved_x, saved_w, blocks_out) = pipelined_loop(
            forward,
            x0,
            self.n_blocks,
            tok,
            fetch=gather,
            fetch_input=lambda u, _: self._unit_weights(blocks, u),
            depth=cfg.prefetch,
            unroll=cfg.unroll,
        )
        head_w, tok = self._gather(params["head"], tok)
        tied_w = None
        if self.tied:
            tied_w, tok = self._gather(params["embed"], tok)
        loss, head_vjp, outer_out = jax.vjp(
            lambda h, e, x: self._head(h, e, x, outer_mid, batch), head_w, tied_w, xl, has_aux=True
        )
        del head_w
        d_head, d_tied, dx = head_vjp(jnp.ones_like(loss))
        head_handle, tok = scatter.start(d_head, tok)

        # backward: re-gather unit i-1 and reduce-scatter unit i+1 while unit i computes
        def backward(unit, w, dx):
            _, vjp = jax.vjp(lambda w, x: self._block(w, block_in(unit), x)[0], w, _index(saved_x, unit))
            dw, dx_in = vjp(dx.astype(saved_x.dtype))
            return dx_in, dw, None

        # each finished shard goes straight into its slot: of the gradient buffer, or (update_in_backward)
        # of the donated parameter and optimizer state buffers, updated in place
        if cfg.update_in_backward:
            finish, acc = self._update_unit, (blocks, opt_state["blocks"])
            master = self.block_bucket.dtype
        else:

            def finish(unit, g, grads, tok):
                g, tok = self._finish_grad(g, tok, master)
                return _set(grads, unit, g), tok

            acc = jnp.zeros(blocks.shape, master)

        if cfg.reshard_after_forward and cfg.update_in_backward:
            # gather from the buffer being updated in place: unit u-1 is gathered before it is updated
            fetch, fetch_input = gather, lambda u, acc: self._unit_weights(acc[0], u)
        elif cfg.reshard_after_forward:
            fetch, fetch_input = gather, lambda u, _: _index(blocks, u)
        else:  # the weights kept from the forward: "fetching" them is reading them
            fetch = kept("fsdp.kept")
            fetch_input = lambda u, _: _index(saved_w, u)
        dx0, tok, block_out, _ = pipelined_loop(
            backward,
            dx,
            self.n_blocks,
            tok,
            fetch=fetch,
            fetch_input=fetch_input,
            emit=scatter,
            finish=finish,
            acc=acc,
            depth=cfg.prefetch,
            reverse=True,
            unroll=cfg.unroll,
        )
        embed_w, tok = self._gather(params["embed"], tok)
        _, embed_vjp = jax.vjp(lambda e: self._embed(e, outer_in, batch)[0], embed_w)
        (d_embed,) = embed_vjp(dx0.astype(x0.dtype))
        if d_tied is not None:
            d_embed = d_embed + d_tied
        g_embed, tok = comm.reduce_scatter(
            d_embed if cfg.reduce_dtype is None else d_embed.astype(cfg.reduce_dtype),
            cfg.axis,
            tok,
            op="mean",
            backend=cfg.backend,
        )
        g_embed, tok = self._finish_grad(g_embed, tok, params["embed"].dtype)
        g_head, tok = scatter.wait(head_handle, tok)
        g_head, tok = self._finish_grad(g_head, tok, params["head"].dtype)

        loss, tok = comm.all_reduce(loss, cfg.batch_axes, tok, op="mean", backend=cfg.backend)
        after = {"outer": outer_out, "blocks": blocks_out}
        new_model_state, tok = self._model_state_after(model_state, after, tok)
        if cfg.update_in_backward:
            new_blocks, new_block_opt = block_out
            new_params = {"blocks": new_blocks}
            new_opt = {"blocks": new_block_opt}
            for name, g in (("embed", g_embed), ("head", g_head)):
                upd, new_opt[name] = self.optimizer.update(g, opt_state[name], params[name])
                new_params[name] = optax.apply_updates(params[name], upd)
            metrics = {"loss": loss, "grad_norm": jnp.float32(jnp.nan), "skipped": jnp.bool_(False)}
            return new_params, new_opt, new_model_state, metrics
        grads = {"embed": g_embed, "head": g_head, "blocks": block_out}
        new_params, new_opt, metrics = self._update(params, opt_state, grads, loss, tok)
        return new_params, new_opt, keep_if(metrics["skipped"], new_model_state, model_state), metrics

    def _model_state_after(self, before, after, tok):
        axes, backend = self.cfg.batch_axes, self.cfg.backend
        outer, tok = self.outer_state.after_step(before["outer"], after["outer"], axes, tok, backend)
        blocks, tok = self.block_state.after_step(before["blocks"], after["blocks"], axes, tok, backend)
        return {"outer": outer, "blocks": blocks}, tok

    def _update_unit(self, unit, g, acc, tok):
        """`finish` for update_in_backward: average the shard (HSDP), then update that unit's slices."""
        fused, others = acc
        g, tok = self._finish_grad(g, tok, fused.dtype)
        p, s = self._unfuse_unit(_index(fused, unit), [_index(x, unit) for x in others])
        upd, s = self.optimizer.update(g, s, p)
        new_rows, new_others = self._fuse(optax.apply_updates(p, upd)[None], jax.tree.map(lambda x: x[None], s))
        fused = _set(fused, unit, new_rows[0])
        others = tuple(_set(whole, unit, part[0]) for whole, part in zip(others, new_others, strict=True))
        return (fused, others), tok

    def _update(self, params, opt_state, grads, loss, tok):
        cfg = self.cfg
        sq = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads))
        sq, tok = comm.all_reduce(sq, cfg.axis, tok, op="sum", backend=cfg.backend)
        norm = jnp.sqrt(sq)
        if cfg.max_grad_norm is not None:
            scale = jnp.minimum(1.0, cfg.max_grad_norm / (norm + 1e-6))
            grads = jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
        new_params, new_opt = {}, {}
        for name in ("embed", "head"):
            upd, new_opt[name] = self.optimizer.update(grads[name], opt_state[name], params[name])
            new_params[name] = optax.apply_updates(params[name], upd)
        upd, new_opt["blocks"] = jax.vmap(self.optimizer.update)(grads["blocks"], opt_state["blocks"], params["blocks"])
        new_params["blocks"] = optax.apply_updates(params["blocks"], upd)
        skipped = jnp.zeros((), jnp.bool_)
        if cfg.skip_nonfinite is not False:
            skipped = ~jnp.isfinite(norm)
            new_params, new_opt = keep_if(skipped, (new_params, new_opt), (params, opt_state))
        return new_params, new_opt, {"loss": loss, "grad_norm": norm, "skipped": skipped}


def _same_arrays(a, b) -> bool:
    """Whether two pytrees have one structure and the same leaf shapes and dtypes."""
    shapes = lambda t: [(x.shape, x.dtype) for x in jax.tree.leaves(t)]
    return jax.tree.structure(a) == jax.tree.structure(b) and shapes(a) == shapes(b)


def _index(stacked, unit):
    """Unit `unit` (an int or a traced index) of a stacked array."""
    if isinstance(unit, int):
        return stacked[unit]
    return lax.dynamic_index_in_dim(stacked, unit, keepdims=False)


def _set(stacked, unit, value):
    """`stacked` with unit `unit` replaced by `value` (in place when `stacked` is dead afterwards)."""
    if isinstance(unit, int):
        return stacked.at[unit].set(value)
    return lax.dynamic_update_index_in_dim(stacked, value.astype(stacked.dtype), unit, 0)
