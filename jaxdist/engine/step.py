"""The train step: a per-device program of local gradients inside one `shard_map`, then the
optimizer on the sharded parameter tree outside it (where global reductions such as clipping are
exact), or with `update_in_backward` each unit updated inside it as soon as its gradients are reduced.

`train_step` takes the per-device program as a parameter: the engine's is `UnitGrads` (forward over
the blocks with the next unit gathered while one computes, then backward with the previous unit
fetched and the next one's gradients reduced while one computes, both `pipelined_loop`s); the
pipeline passes its schedule's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxdist import comm
from jaxdist.compat import model_sharding_dropped
from jaxdist.core.model_state import keep_if
from jaxdist.core.step import TrainState, optimizer_step
from jaxdist.engine.apply import UnitCode
from jaxdist.engine.layout import Layout
from jaxdist.engine.options import Options, axis_arg
from jaxdist.engine.prefetch import kept, pipelined_loop
from jaxdist.engine.residuals import rebuild, weight_only, weight_only_values
from jaxdist.engine.unit_comm import UnitComm, fetch


def train_step(
    cfg: Options,
    layout: Layout,
    optimizer,
    state_shardings: TrainState,
    local_grads: Callable,
    aux_specs=None,
) -> Callable:
    """`step(state, batch) -> (state, metrics)` around the per-device program `local_grads`.

    Args:
      cfg, layout: the engine's options and the parameters' layout (their specs are the program's).
      optimizer: the optax transformation.
      state_shardings: the train state's shardings.
      local_grads: `local_grads(params, model_state, step, batch) -> (grads, model_state, metrics)`
        on this device's pieces (`metrics["loss"]` replicated, `metrics["aux"]` as `aux_specs`);
        with `cfg.update_in_backward` it also takes `opt_state` and returns `((params, opt_state),
        model_state, metrics)`, the updated state instead of gradients.
      aux_specs: the out specs of `metrics["aux"]`, or None when there is none.
    """
    mesh = layout.mesh

    def step(state: TrainState, batch):
        batch_spec = cfg.batch_spec
        batch = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, layout.sharding(batch_spec)), batch)
        specs = layout.specs()
        metrics_spec = {"loss": P()}
        if aux_specs is not None:
            metrics_spec["aux"] = aux_specs
        if cfg.record_weights:
            metrics_spec["weights_used"] = metrics_spec["weights_used_backward"] = P()
        if cfg.update_in_backward:  # the optimizer runs inside, unit by unit
            opt_specs = jax.tree.map(lambda s: s.spec, state_shardings.opt_state)
            body = jax.shard_map(
                local_grads,
                mesh=mesh,
                in_specs=(specs, P(), P(), batch_spec, opt_specs),
                out_specs=((specs, opt_specs), P(), metrics_spec),
                check_vma=False,
            )
            (params, opt_state), model_state, metrics = body(
                state.params, state.model_state, state.step, batch, state.opt_state
            )
            new = TrainState(params, opt_state, state.step + 1, model_state)
            return new, {**metrics, "grad_norm": jnp.float32(jnp.nan), "skipped": jnp.zeros((), jnp.bool_)}
        body = jax.shard_map(
            local_grads,
            mesh=mesh,
            in_specs=(specs, P(), P(), batch_spec),
            out_specs=(specs, P(), metrics_spec),
            # the rank's program as written: its data-axis reductions are explicit, and the sums over tp
            # that JAX's types would add are decided at prepare (`jaxdist.engine.apply`)
            check_vma=False,
        )
        grads, model_state, metrics = body(state.params, state.model_state, state.step, batch)
        params, opt_state, norm, skipped = optimizer_step(
            optimizer,
            state.params,
            state.opt_state,
            grads,
            max_grad_norm=cfg.max_grad_norm,
            skip_nonfinite=cfg.skips_nonfinite,
            loss=metrics["loss"],
        )
        if cfg.skips_nonfinite:
            model_state = keep_if(skipped, model_state, state.model_state)
        params = jax.lax.with_sharding_constraint(params, state_shardings.params)
        opt_state = jax.lax.with_sharding_constraint(opt_state, state_shardings.opt_state)
        new = TrainState(params, opt_state, state.step + 1, model_state)
        return new, {**metrics, "grad_norm": norm, "skipped": skipped}

    return step


def update_unit(optimizer, treedef, opt_owners, gs: dict, acc, params, opt_state, layer=None):
    """update_in_backward: the leaves `gs` names (layer `layer` of stacked ones) updated from the
    step's values, into `acc` = (parameter leaves, optimizer state leaves). The optimizer runs on
    the whole tree with zero gradients elsewhere, results XLA drops: exact for the per-leaf
    transformations `prepare` admits (`jaxdist.core.per_leaf`); shared state (a count) is the same
    from every unit."""
    new_p, new_s = list(acc[0]), list(acc[1])

    def sliced(k):
        return layer is not None and k in gs

    def piece(x, k):
        return x[layer] if sliced(k) else x

    def put(whole, k, x):
        return whole.at[layer].set(x) if sliced(k) else x

    p_in = [piece(x, k) for k, x in enumerate(jax.tree.leaves(params))]
    g_in = [gs[k].astype(x.dtype) if k in gs else jnp.zeros_like(x) for k, x in enumerate(p_in)]
    s_in = [piece(x, o) for x, o in zip(jax.tree.leaves(opt_state), opt_owners, strict=True)]
    tree, s_tree = treedef.unflatten, jax.tree.structure(opt_state)
    updates, s_out = optimizer.update(tree(g_in), s_tree.unflatten(s_in), tree(p_in))
    p_out = jax.tree.leaves(optax.apply_updates(tree(p_in), updates))
    for k in gs:
        new_p[k] = put(new_p[k], k, p_out[k])
    for j, (o, x) in enumerate(zip(opt_owners, jax.tree.leaves(s_out), strict=True)):
        if o is None or o in gs:
            new_s[j] = put(new_s[j], o, x)
    return new_p, new_s


class _Trace:
    """What one trace of `UnitGrads` shares between its forward and backward loops: the inputs, and
    per block what the forward keeps (its input, gathered weights, vjp residuals, variables after)."""

    def __init__(self, grads: UnitGrads, pieces: dict, batch, blocks_in: list):
        self.grads, self.code, self.cfg = grads, grads.code, grads.cfg
        self.pieces, self.batch, self.blocks_in = pieces, batch, blocks_in
        self.mode = self.cfg.backward_residuals
        self.saved_x, self.saved_w, self.saved_vjp, self.used, self.blocks_out = [], [], [], [], []

    def unit(self, ks) -> dict:
        return {k: self.pieces[k] for k in ks}

    def block_unit(self, i: int, _acc=None) -> dict:
        """Block i's stored pieces (layer i of every stacked leaf)."""
        if self.code.units.stacked:
            return {k: self.pieces[k][i] for k in self.code.block_leaves[i]}
        return self.unit(self.code.block_leaves[i])

    def saved_unit(self, i: int, _acc=None) -> dict:
        return self.saved_w[i]

    def side(self, i: int):
        """Block i's inputs besides its weights and activations."""
        return (self.batch, self.blocks_in[i] if self.blocks_in else None)

    def block_with_side(self, i: int) -> Callable:
        """Block i as `fn(w, x, side) -> (y, variables after)`."""

        def block(w, x, side):
            return self.code.block(i, w, x, *side)

        return block

    def block_fn(self, i: int) -> Callable:
        """Block i as `fn(w, x) -> (y, variables after)`, recomputed in backward with `remat`."""

        def block(w, x):
            return self.block_with_side(i)(w, x, self.side(i))

        return jax.checkpoint(block) if self.cfg.remat else block

    def forward(self, i, w, x):
        self.saved_x.append(x)
        self.saved_w.append(w)  # dropped by XLA when backward gathers again
        if self.cfg.record_weights:
            self.used.append(self.grads.weight_sum(w))
        if self.mode == "recompute":  # backward recomputes on re-gathered weights: keep no residual of them
            y, after = self.block_fn(i)(w, x)
        else:  # the residuals as plain autodiff keeps them
            y, vjp, after = jax.vjp(self.block_fn(i), w, x, has_aux=True)
            if self.mode == "rebuild":  # but none computed from the weights alone: those hold the gathered weights
                leaves, tree = jax.tree.flatten(vjp)
                drop = self.grads.weight_only(i, self.block_with_side(i), w, x, self.side(i))
                if len(drop) != len(leaves):
                    raise AssertionError(f"block {i}: {len(leaves)} residuals, the analysis traced {len(drop)}")
                vjp = (tree, [None if d else leaf for leaf, d in zip(leaves, drop, strict=True)])
            self.saved_vjp.append(vjp)
        self.blocks_out.append(after)
        return y, None, None

    def backward(self, i, w, carry):
        y = self.grads.weight_sum(w) if self.cfg.record_weights else None
        if self.mode == "kept":
            dw, dx_in = self.saved_vjp[i](carry)
            return dx_in, dw, y
        if self.mode == "rebuild":
            # the weights' own residuals from the re-gathered weights (values XLA cannot merge with the
            # forward's: each gather packs its own copy); only their equations run, none reads x
            tree, kept_leaves = self.saved_vjp[i]
            drop = [k is None for k in kept_leaves]
            x_aval = jax.ShapeDtypeStruct(self.saved_x[i].shape, self.saved_x[i].dtype)
            fresh = weight_only_values(self.block_with_side(i), w, x_aval, self.side(i), drop)
            dw, dx_in = rebuild(tree, kept_leaves, fresh)(carry)
            return dx_in, dw, y
        # replayed on the saved input, which rides in the carry: tied like the gradient, after the
        # next gather was issued, so the replay runs no earlier, on a value XLA cannot merge (CSE)
        # with the forward's (nothing of the forward is kept for it, as after remat); the same
        # inputs and variables as forward: the same dropout masks
        dx, x = carry
        _, vjp, _ = jax.vjp(self.block_fn(i), w, x, has_aux=True)
        dw, dx_in = vjp(dx)
        return (dx_in, self.saved_x[i - 1] if i else x), dw, y


class UnitGrads:
    """The engine's per-device program: `grads(params, model_state, step, batch)` -> this rank's
    gradient pieces, the model state after the step and the metrics; with `opt_state`
    (update_in_backward) the updated parameters and optimizer state instead of gradients, each
    unit updated as soon as it is reduced."""

    def __init__(self, cfg: Options, code: UnitCode, unit_comm: UnitComm, optimizer, opt_owners: list):
        self.cfg, self.code, self.comm = cfg, code, unit_comm
        self.split, self.layout = code.split, code.layout
        self.optimizer, self.opt_owners = optimizer, opt_owners
        self._weight_only_cache: dict = {}

    @model_sharding_dropped()  # the per-device program: the model's own sharding annotations are no-ops
    def __call__(self, params, model_state, step, batch, opt_state=None):
        cfg, code = self.cfg, self.code
        in_backward = opt_state is not None
        outer_in, blocks_in = self.step_variables(model_state, step)
        gather, reduce = self.comm.gather, self.comm.reduce
        trace = _Trace(self, dict(enumerate(jax.tree.leaves(params))), batch, blocks_in)
        tok = comm.token()

        # forward: the embedding, then block i+1 gathered while block i computes
        embed_w, tok = fetch(gather, trace.unit(code.embed_leaves), tok)
        x0, embed_vjp, outer_mid = jax.vjp(
            functools.partial(code.embed, batch=batch, stored=outer_in), embed_w, has_aux=True
        )
        depth = min(cfg.prefetch, self.split.n_blocks)
        xl, tok, _, _ = pipelined_loop(
            trace.forward,
            x0,
            self.split.n_blocks,
            tok,
            fetch=gather,
            fetch_input=trace.block_unit,
            depth=depth,
            unroll=True,
        )
        head_w, tok = fetch(gather, trace.unit(code.head_leaves), tok)
        total, head_vjp, (count, aux, outer_out) = jax.vjp(
            functools.partial(code.head, batch=batch, stored=outer_mid), head_w, xl, has_aux=True
        )
        seed, count, tok = self.loss_seed(total, count, tok)
        d_head, dx = head_vjp(seed)
        tied = {k: d_head.pop(k) for k in code.tied}
        head_handle, tok = reduce.start(d_head, tok) if d_head else (None, tok)

        # backward: block i-1 fetched and block i+1's gradients reduced while block i computes
        def finish(i, g, acc, tok):
            if in_backward:
                return self.update(g, acc, params, opt_state, i if code.units.stacked else None), tok
            return {**acc, i: g}, tok

        recompute = trace.mode == "recompute"
        dx0, tok, per_block, used_backward = pipelined_loop(
            trace.backward,
            (dx, trace.saved_x[-1]) if recompute else dx,
            self.split.n_blocks,
            tok,
            fetch=gather if cfg.regather else kept("engine.kept"),
            fetch_input=trace.block_unit if cfg.regather else trace.saved_unit,
            emit=reduce,
            finish=finish,
            acc=(jax.tree.leaves(params), jax.tree.leaves(opt_state)) if in_backward else {},
            depth=depth,
            reverse=True,
            unroll=True,
        )
        if recompute:
            dx0 = dx0[0]
        grads = {} if in_backward else self.block_grads(per_block)
        (d_embed,) = embed_vjp(dx0)
        d_embed = {k: g + tied[k] if k in tied else g for k, g in d_embed.items()}
        g_embed, tok = fetch(reduce, d_embed, tok)
        grads = {**grads, **g_embed}
        if head_handle is not None:
            g_head, tok = reduce.wait(head_handle, tok)
            grads.update(g_head)
        if in_backward:
            new_params, new_opt = self.update(grads, per_block, params, opt_state)
        metrics, tok = self.metrics(total, count, aux, trace, used_backward, tok)
        new_model_state, tok = self.model_state_after(model_state, outer_out, trace.blocks_out, tok)
        if in_backward:
            updated = (self.layout.unflatten(new_params), jax.tree.structure(opt_state).unflatten(new_opt))
            return updated, new_model_state, metrics
        out = [grads[k].astype(self.layout.leaves[k].dtype) for k in range(len(self.layout.leaves))]
        return self.layout.unflatten(out), new_model_state, metrics

    def step_variables(self, model_state, step):
        """The outer and the blocks' variables for this step: RNG streams folded with the step and this
        data rank (every tp rank of it draws the same)."""
        cfg, split = self.cfg, self.split
        rank = jax.lax.axis_index(axis_arg(cfg.data_axes)) if cfg.data_axes else 0
        outer_in = split.outer_state.for_step(model_state["outer"], rank, step)
        # under sequence parallelism a block sees only values that differ per tp rank (its chunk of the
        # tokens, then its heads / features), so each tp rank draws its own masks, as one device draws
        # one per token; without it the activations between tp layers are whole and every tp rank must
        # draw the same
        block_rank = rank * cfg.tp + jax.lax.axis_index(cfg.tp_axis) if cfg.sequence_parallel else rank
        blocks_in = [
            ms.for_step(model_state["blocks"][i], block_rank, step) for i, ms in enumerate(split.block_states or [])
        ]
        return outer_in, blocks_in

    def loss_seed(self, total, count, tok):
        """The cotangent of the head's loss, and the global count (sum_and_count) in float32."""
        cfg = self.cfg
        seed = jnp.ones_like(total)
        if count is not None:  # d(global sum / global count): the data-rank mean below restores the sum
            count = count.astype(jnp.float32)
            if cfg.data_axes:
                count, tok = comm.all_reduce(count, axis_arg(cfg.data_axes), tok, op="sum", backend=cfg.backend)
            seed = (seed * cfg.data_ranks / count).astype(total.dtype)
        return seed, count, tok

    def block_grads(self, per_block: dict) -> dict:
        """The blocks' gradients by leaf (the stacked leaves' layer by layer)."""
        n, block_leaves = self.split.n_blocks, self.code.block_leaves
        if self.code.units.stacked:
            return {k: jnp.stack([per_block[i][k] for i in range(n)]) for k in block_leaves[0]}
        return {k: g for i in range(n) for k, g in per_block[i].items()}

    def update(self, gs: dict, acc, params, opt_state, layer=None):
        return update_unit(self.optimizer, self.layout.treedef, self.opt_owners, gs, acc, params, opt_state, layer)

    def metrics(self, total, count, aux, trace: _Trace, used_backward, tok):
        """The loss (float32 whatever the compute dtype, over all data ranks), aux, and the weights used."""
        cfg = self.cfg
        loss = total.astype(jnp.float32)
        if cfg.data_axes:
            op = "mean" if count is None else "sum"
            loss, tok = comm.all_reduce(loss, axis_arg(cfg.data_axes), tok, op=op, backend=cfg.backend)
        if count is not None:
            loss = loss / count.astype(loss.dtype)
        metrics = {"loss": loss}
        if aux is not None:
            aux, tok = self.reduce_aux(aux, tok)
            metrics["aux"] = aux
        if cfg.record_weights:
            for key, sums in (("weights_used", jnp.stack(trace.used)), ("weights_used_backward", used_backward)):
                if cfg.tp > 1:
                    sums, tok = comm.all_reduce(sums, cfg.tp_axis, tok, op="sum", backend=cfg.backend)
                metrics[key] = sums
        return metrics, tok

    def model_state_after(self, before, outer_out, blocks_out, tok):
        """What the step stores (`ModelState.after_step`): batch statistics averaged over the mesh (the
        data ranks' local statistics; tp ranks hold equal ones, or sequence chunks' under sequence
        parallelism), RNG keys as they were, other variables as the forward left them."""
        axes, backend = axis_arg(self.cfg.mesh.axis_names), self.cfg.backend
        outer, tok = self.split.outer_state.after_step(before["outer"], outer_out, axes, tok, backend)
        blocks = {}
        for i, ms in enumerate(self.split.block_states or []):
            blocks[i], tok = ms.after_step(
                before["blocks"][i], blocks_out[i], axes, tok, backend, check_written=not self.cfg.remat
            )
        return {"outer": outer, "blocks": blocks}, tok

    def reduce_aux(self, aux, tok):
        """Average the scalar-like aux leaves over the data ranks (per-example ones leave as they are)."""
        leaves, tree = jax.tree.flatten(aux)
        specs = jax.tree.leaves(self.code.aux_specs, is_leaf=lambda s: isinstance(s, P))
        out = []
        for x, spec in zip(leaves, specs, strict=True):
            if spec == P() and self.cfg.data_axes:
                x, tok = comm.all_reduce(
                    x.astype(jnp.float32), axis_arg(self.cfg.data_axes), tok, op="mean", backend=self.cfg.backend
                )
            out.append(x)
        return tree.unflatten(out), tok

    def weight_only(self, i: int, fn, w, x, side) -> tuple[bool, ...]:
        """Which residuals of block i's vjp are functions of its weights alone (`jaxdist.engine.residuals`),
        traced once per block definition and shapes (blocks of one definition run one program)."""
        # weak types too: JAX orders a vjp's residuals differently when a weight's cast is an op or not
        avals = tuple((a.shape, a.dtype, jax.typeof(a).weak_type) for a in jax.tree.leaves((w, x, side)))
        key = (self.split.block_kinds[i], len(w), jax.tree.structure((x, side)), avals)
        if key not in self._weight_only_cache:
            self._weight_only_cache[key] = weight_only(fn, w, x, side)
        return self._weight_only_cache[key]

    def weight_sum(self, ws: dict):
        """Sum of a unit's gathered weights, replicated pieces counted once over tp."""
        tp, leaves = self.cfg.tp, self.layout.leaves
        return sum(jnp.sum(w.astype(jnp.float32)) / (tp if leaves[k].tp_dim is None else 1) for k, w in ws.items())
