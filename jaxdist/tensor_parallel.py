"""Tensor parallelism over `tp` composed with ZeRO-1 over `dp`, weights gathered one block ahead.

Each block's weights are first split over `tp` the Megatron way (see
`jaxdist.train.gpt_tp`), and each tp rank's piece is then stored as a flat
shard over `dp` (ZeRO-1: parameters and optimizer state 1/dp per device).

A step gathers block i+1's piece over `dp` while block i computes (forward,
one block ahead), keeps the gathered weights for backward (ZeRO-1 keeps the
step's parameters), and reduce-scatters block i's gradients over `dp` while
block i-1 runs backward, finished one block later. Both loops are
`jaxdist._pipeline.pipelined_loop`.

Publication is data flow (seed 000): the weights a block computes with are
the value returned by the `wait` that finished its `dp` gather in this step.
There is no other reference to them, so reading them early, or reading last
step's, cannot be written. With `remat=True` each block is wrapped in
`jax.checkpoint`; the gathered weights are its inputs, so the replayed forward
reads them again and issues no second gather.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist import comm
from jaxdist._pipeline import AsyncOp, pipelined_loop
from jaxdist._step import TrainState, local_batch_avals, sharded_step
from jaxdist.buckets import bucket_layout, pack_bucket, param_name, unpack_bucket
from jaxdist.comm._backend import get_backend
from jaxdist.fsdp import _index
from jaxdist.model_state import check_identical_blocks
from jaxdist.train import gpt_tp


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """Options of DP x TP training.

    Attributes:
      mesh: the device mesh, with axes `dp_axis` and `tp_axis`.
      dp_axis / tp_axis: the data-parallel and tensor-parallel axes.
      sequence_parallel: split norms and residuals along the sequence over `tp`.
      remat: `jax.checkpoint` each block (keep only its input for backward).
      max_grad_norm: clip by the global gradient norm (weights replicated over
        `tp` counted once), or None.
      unroll: unroll the block loops (always so with the nccl backend).
      backend: the `jaxdist.comm` backend.
      spec: the module that splits and runs the model per tp rank (default: the GPT's).
    """

    mesh: jax.sharding.Mesh
    dp_axis: str = "dp"
    tp_axis: str = "tp"
    sequence_parallel: bool = False
    remat: bool = True
    max_grad_norm: float | None = None
    unroll: bool = False
    backend: str | None = None
    spec: ModuleType = gpt_tp

    def __post_init__(self):
        for name in (self.dp_axis, self.tp_axis):
            if name not in self.mesh.axis_names:
                names = self.mesh.axis_names
                raise ValueError(f"TensorParallel: axis {name!r} is not a mesh axis; the mesh has {names}")

    @property
    def dp(self) -> int:
        return self.mesh.shape[self.dp_axis]

    @property
    def tp(self) -> int:
        return self.mesh.shape[self.tp_axis]

    def prepare(self, model: nnx.Module, optimizer: optax.GradientTransformation, batch) -> TPRun:
        """Split `model` over the mesh and build the train step.

        Args:
          model: a `jaxdist.train.gpt.GPT` (or a model `spec` knows).
          optimizer: an elementwise optax transformation (it sees flat shards).
          batch: an example global batch; its leading dimension is split over `dp`.
        """
        return TPRun(self, model, optimizer, batch)


class TPRun:
    """A prepared DP x TP run: `state`, `step(state, batch) -> (state, metrics)`, `params(state)`."""

    def __init__(self, cfg: TensorParallel, model, optimizer, batch):
        self.cfg, self.optimizer, self.spec = cfg, optimizer, cfg.spec
        self.model_cfg = model.cfg
        self.spec.check(self.model_cfg, cfg.tp)
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        _check_no_model_state(self.rest)
        check_identical_blocks(model.blocks, "TensorParallel")
        self.template = params
        pure = nnx.to_pure_dict(params)
        self.tied = self.model_cfg.tie_embeddings
        self.n_blocks = len(pure["blocks"])
        local_batch_avals(batch, cfg.dp, "TensorParallel", f"dp={cfg.dp}; change the batch size")
        block_parts = [
            [self.spec.split_block(pure["blocks"][i], r, cfg.tp) for r in range(cfg.tp)] for i in range(self.n_blocks)
        ]
        outer_parts = [self.spec.split_outer(pure, r, cfg.tp, self.tied) for r in range(cfg.tp)]
        # every tp rank's piece has the same structure: one flat layout per unit kind
        self.block_tree = jax.tree.structure(block_parts[0][0])
        self.embed_tree = jax.tree.structure(outer_parts[0][0])
        self.head_tree = jax.tree.structure(outer_parts[0][1])
        self.block_bucket = bucket_layout(block_parts[0][0], cfg.dp, bucket_size=None).buckets[0]
        self.embed_bucket = bucket_layout(outer_parts[0][0], cfg.dp, bucket_size=None).buckets[0]
        self.head_bucket = bucket_layout(outer_parts[0][1], cfg.dp, bucket_size=None).buckets[0]
        self.norm_weights = {
            "embed": self._norm_weights(self.embed_bucket, outer_parts[0][0]),
            "head": self._norm_weights(self.head_bucket, outer_parts[0][1]),
            "blocks": self._norm_weights(self.block_bucket, block_parts[0][0]),
        }
        self.state = self._init_state(block_parts, outer_parts)
        self.step = jax.jit(self._step, donate_argnums=0)

    def _norm_weights(self, bucket, tree) -> np.ndarray:
        """Per element of a unit's flat piece: 1, or 1/tp where every tp rank holds the same value."""
        names = [param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        leaves = [
            np.full(x.shape, 1 / self.cfg.tp if self.spec.replicated(n) else 1.0, np.float32)
            for n, x in zip(names, jax.tree.leaves(tree), strict=True)
        ]
        return np.asarray(pack_bucket(bucket, leaves, np.float32))

    def _ctx(self) -> gpt_tp.Context:
        cfg = self.cfg
        return gpt_tp.Context(cfg.tp_axis, cfg.tp, cfg.backend, cfg.sequence_parallel)

    # -- state -------------------------------------------------------------------

    def _specs(self):
        d, t = self.cfg.dp_axis, self.cfg.tp_axis
        return {"embed": P(t, d), "head": P(t, d), "blocks": P(None, t, d)}

    def _sharding(self, spec):
        return NamedSharding(self.cfg.mesh, spec)

    def _opt_specs(self, params):
        d, t = self.cfg.dp_axis, self.cfg.tp_axis
        by_rank = {2: P(t, d), 3: P(None, t, d)}
        return jax.tree.map(lambda s: by_rank.get(s.ndim, P()), jax.eval_shape(self.optimizer.init, params))

    def _init_state(self, block_parts, outer_parts) -> TrainState:
        def pack_all(block_parts, outer_parts):
            flat = lambda bucket, tree: pack_bucket(bucket, jax.tree.leaves(tree))
            return {
                "embed": jnp.stack([flat(self.embed_bucket, e) for e, _ in outer_parts]),
                "head": jnp.stack([flat(self.head_bucket, h) for _, h in outer_parts]),
                "blocks": jnp.stack([jnp.stack([flat(self.block_bucket, p) for p in parts]) for parts in block_parts]),
            }

        shardings = {k: self._sharding(v) for k, v in self._specs().items()}
        params = jax.jit(pack_all, out_shardings=shardings)(block_parts, outer_parts)
        opt_shardings = jax.tree.map(self._sharding, self._opt_specs(params), is_leaf=lambda x: isinstance(x, P))
        opt_state = jax.jit(self.optimizer.init, out_shardings=opt_shardings)(params)
        return TrainState(params, opt_state, jax.device_put(jnp.zeros((), jnp.int32), self._sharding(P())))

    def _unpack(self, bucket, tree, flat):
        values = unpack_bucket(bucket, flat, flat.dtype)
        return tree.unflatten([values[i] for i in range(len(values))])

    def params(self, state: TrainState):
        """The full parameters (an `nnx.State`, as the single-device model has them)."""
        full = jax.device_put(state.params, self._sharding(P()))
        tp = self.cfg.tp
        embeds = [self._unpack(self.embed_bucket, self.embed_tree, full["embed"][r]) for r in range(tp)]
        heads = [self._unpack(self.head_bucket, self.head_tree, full["head"][r]) for r in range(tp)]
        pure = self.spec.join_outer(embeds, heads, self.tied)
        pure["blocks"] = {
            i: self.spec.join_block(
                [self._unpack(self.block_bucket, self.block_tree, full["blocks"][i, r]) for r in range(tp)]
            )
            for i in range(self.n_blocks)
        }
        state = jax.tree.map(lambda x: x, self.template)
        nnx.replace_by_pure_dict(state, pure)
        return state

    def model(self, state: TrainState) -> nnx.Module:
        return nnx.merge(self.graphdef, self.params(state), self.rest)

    # -- the step ----------------------------------------------------------------

    def _step(self, state: TrainState, batch):
        return sharded_step(
            self._local_step,
            self.cfg.mesh,
            state,
            batch,
            param_specs=self._specs(),
            opt_specs=self._opt_specs(state.params),
            batch_spec=P(self.cfg.dp_axis),
            metrics=("loss", "grad_norm", "weights_used"),
        )

    def _local_step(self, params, opt_state, model_state, step, batch):
        cfg, spec, ctx = self.cfg, self.spec, self._ctx()
        loops = get_backend(cfg.backend).handles_cross_loops

        def gather_start(x, tok):
            return comm.all_gather_start(x, cfg.dp_axis, tok, backend=cfg.backend)

        def scatter_start(g, tok):
            return comm.reduce_scatter_start(g, cfg.dp_axis, tok, op="mean", backend=cfg.backend)

        gather = AsyncOp(gather_start, comm.wait, "tp.gather", loops)
        scatter = AsyncOp(scatter_start, comm.wait, "tp.scatter", loops)
        kept = AsyncOp(lambda w, tok: ((w,), tok), lambda h, tok: (h[0], tok), "tp.kept", loops)
        shards = {k: v[:, 0] if k == "blocks" else v[0] for k, v in params.items()}  # drop the local tp dim
        tok = comm.token()

        def embed_fn(e_flat):
            return spec.embed(self._unpack(self.embed_bucket, self.embed_tree, e_flat), batch, ctx)

        def block_fn(w_flat, x):
            return spec.block(self._unpack(self.block_bucket, self.block_tree, w_flat), x, ctx, self.model_cfg.n_heads)

        def head_fn(h_flat, e_flat, x):
            h = self._unpack(self.head_bucket, self.head_tree, h_flat)
            e = self._unpack(self.embed_bucket, self.embed_tree, e_flat)
            return spec.head_loss(h, e, x, batch, ctx)

        if cfg.remat:
            block_fn = jax.checkpoint(block_fn)

        h, tok = gather.start(shards["embed"], tok)
        embed_w, tok = gather.wait(h, tok)
        x0, embed_vjp = jax.vjp(embed_fn, embed_w)

        def forward(unit, w, x):
            # `w` is the value the dp gather of this unit returned in this step: the only way to it
            return block_fn(w, x), None, (x, w, jnp.sum(w.astype(jnp.float32)))

        xl, tok, _, (saved_x, saved_w, used) = pipelined_loop(
            forward,
            x0,
            self.n_blocks,
            tok,
            fetch=gather,
            fetch_input=lambda u, _: _index(shards["blocks"], u),
            unroll=cfg.unroll,
        )
        h, tok = gather.start(shards["head"], tok)
        head_w, tok = gather.wait(h, tok)
        loss, head_vjp = jax.vjp(head_fn, head_w, embed_w, xl)
        d_head, d_embed_tied, dx = head_vjp(jnp.ones_like(loss))
        head_handle, tok = scatter.start(d_head, tok)

        def backward(unit, w, dx):
            _, vjp = jax.vjp(block_fn, w, _index(saved_x, unit))
            dw, dx_in = vjp(dx)
            return dx_in, dw, None

        dx0, tok, g_blocks, _ = pipelined_loop(
            backward,
            dx,
            self.n_blocks,
            tok,
            fetch=kept,
            fetch_input=lambda u, _: _index(saved_w, u),
            emit=scatter,
            reverse=True,
            unroll=cfg.unroll,
        )
        (d_embed,) = embed_vjp(dx0)
        g_embed, tok = comm.reduce_scatter(d_embed + d_embed_tied, cfg.dp_axis, tok, op="mean", backend=cfg.backend)
        g_head, tok = scatter.wait(head_handle, tok)
        grads = {"embed": g_embed, "head": g_head, "blocks": g_blocks}

        loss, tok = comm.all_reduce(loss, cfg.dp_axis, tok, op="mean", backend=cfg.backend)
        # each tp rank's sum of the weights its blocks computed with, summed over tp: for tests
        used, tok = comm.all_reduce(used, cfg.tp_axis, tok, op="sum", backend=cfg.backend)
        # the global norm: this dp rank's slice of each unit's per-element weights
        rank = jax.lax.axis_index(cfg.dp_axis)

        def weighted(name, g):
            w = jnp.asarray(self.norm_weights[name])
            w = jax.lax.dynamic_slice_in_dim(w, rank * g.shape[-1], g.shape[-1])
            return jnp.sum(jnp.square(g.astype(jnp.float32)) * w)

        sq = sum(weighted(name, g) for name, g in grads.items())
        for axis in (cfg.dp_axis, cfg.tp_axis):  # one axis at a time: needs only per-axis communicators
            sq, tok = comm.all_reduce(sq, axis, tok, op="sum", backend=cfg.backend)
        norm = jnp.sqrt(sq)
        if cfg.max_grad_norm is not None:
            scale = jnp.minimum(1.0, cfg.max_grad_norm / (norm + 1e-6))
            grads = {k: (g * scale).astype(g.dtype) for k, g in grads.items()}
        # back to the local (.., 1, shard) shapes of the state, for the elementwise update
        grads = {k: g[:, None] if k == "blocks" else g[None] for k, g in grads.items()}
        updates, new_opt = self.optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        return new_params, new_opt, model_state, {"loss": loss, "grad_norm": norm, "weights_used": used}


def _check_no_model_state(rest: nnx.State) -> None:
    """TP runs the model through `spec`'s own forward, which reads parameters only: refuse anything else."""
    paths = [param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(rest))[0]]
    if paths:
        shown = ", ".join(paths[:4]) + (", ..." if len(paths) > 4 else "")
        raise ValueError(
            f"TensorParallel: the model has non-parameter variables ({shown}) "
            "(dropout RNG streams, batch statistics or constants) that its tensor-parallel forward would ignore; "
            "remove them or train with DDP or FSDP, which carry them"
        )
