"""Validation loss: mean next-token cross-entropy over the first `batches` validation batches.

It runs on the full parameters of the train state (`run.model(state)`, as the
strategy assembles them, replicated) in a `shard_map` over the training batch
sharding: each device sums the loss of its rows, then the sums over the batch
axes. So it is data-parallel on the same mesh and does no gradient work. The
validation batches are the same ones at every evaluation (rows in order), so the
curve compares like with like. A split with fewer rows than `batches` batches is
read once: every row counts once, and the padding of its last, partial batch
weighs nothing (a row read twice would weigh twice).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.models.gpt import next_token_loss
from jaxdist.train.data.shards import Loader, ShardData


class Evaluator:
    """`evaluator(model) -> mean loss` over the validation batches; `loss_fn(model, batch)` is the model
    family's next-token loss (default: the GPT's)."""

    def __init__(self, loader: Loader, batches: int, loss_fn=next_token_loss):
        if batches < 1:
            raise ValueError(f"run.eval_batches must be >= 1, got {batches}")
        self.loader, self.n_batches, self.loss_fn = loader, batches, loss_fn
        self.batches: list[tuple[dict, jax.Array]] | None = None  # (batch, row weights), read once, kept on devices
        self.loss = None  # built on first use, for the model's graph

    def _build(self, graphdef):
        sharding = self.loader.sharding
        axes = sharding.spec[0]

        def local_sums(params, batch, weights):
            model = nnx.merge(graphdef, params)
            # each row's loss (the one loss function, a row at a time), so padding rows can weigh 0
            per_row = jax.vmap(lambda tokens: self.loss_fn(model, {"tokens": tokens[None]}))(batch["tokens"])
            return jax.lax.psum(jnp.stack([(per_row * weights).sum(), weights.sum()]), axes)

        spec = {"tokens": sharding.spec}
        return jax.jit(jax.shard_map(local_sums, mesh=sharding.mesh, in_specs=(P(), spec, P(axes)), out_specs=P()))

    def _read(self) -> list[tuple[dict, jax.Array]]:
        """The evaluated batches with a weight per row: 1, or 0 for samples past the end of a small split."""
        size = self.loader.batch_size
        rows = len(self.loader.data.windows) if isinstance(self.loader.data, ShardData) else None
        count = self.n_batches * size if rows is None else min(self.n_batches * size, rows)
        stream = self.loader.batches(0)
        weights_sharding = NamedSharding(self.loader.sharding.mesh, P(self.loader.sharding.spec[0]))
        out = []
        for b in range(math.ceil(count / size)):
            w = (np.arange(b * size, (b + 1) * size) < count).astype(np.float32)
            out.append((next(stream), jax.make_array_from_callback((size,), weights_sharding, lambda i, w=w: w[i])))
        return out

    def __call__(self, model: nnx.Module) -> float:
        """The mean loss of `model` over the validation rows (every process gets the same value)."""
        if self.batches is None:
            self.batches = self._read()
        graphdef, params = nnx.split(model)
        if self.loss is None:
            self.loss = self._build(graphdef)
        # one batch's program at a time: independent programs in flight together may run their collectives
        # in another order in each process (a multi-process hang), so none is started before the last ends
        sums = [jax.block_until_ready(self.loss(params, batch, weights)) for batch, weights in self.batches]
        # every row has seq_len tokens: the mean over rows is the mean over all their tokens
        total = np.sum([np.asarray(x.addressable_data(0), np.float64) for x in sums], axis=0)
        return float(total[0] / total[1])
