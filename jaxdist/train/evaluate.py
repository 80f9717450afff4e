"""Validation loss: mean next-token cross-entropy over the first `batches` validation batches.

It runs on the full parameters of the train state (`run.model(state)`, as the
strategy assembles them, replicated) in a `shard_map` over the training batch
sharding: each device takes the loss of its rows, then the mean over the batch
axes. So it is data-parallel on the same mesh and does no gradient work. The
validation batches are the same ones at every evaluation (rows in order), so the
curve compares like with like.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxdist.train.gpt import GPT, next_token_loss
from jaxdist.train.shards import Loader


class Evaluator:
    def __init__(self, loader: Loader, batches: int):
        if batches < 1:
            raise ValueError(f"run.eval_batches must be >= 1, got {batches}")
        self.loader, self.n_batches = loader, batches
        self.batches: list[dict] | None = None  # read once, kept on the devices
        self.loss = None  # built on first use, for the model's graph

    def _build(self, graphdef):
        sharding = self.loader.sharding
        axes = sharding.spec[0]

        def local_loss(params, batch):
            return jax.lax.pmean(next_token_loss(nnx.merge(graphdef, params), batch), axes)

        spec = {"tokens": sharding.spec}
        return jax.jit(jax.shard_map(local_loss, mesh=sharding.mesh, in_specs=(P(), spec), out_specs=P()))

    def __call__(self, model: GPT) -> float:
        """The mean loss of `model` over the validation batches (every process gets the same value)."""
        if self.batches is None:
            stream = self.loader.batches(0)
            self.batches = [next(stream) for _ in range(self.n_batches)]
        graphdef, params = nnx.split(model)
        if self.loss is None:
            self.loss = self._build(graphdef)
        losses = [self.loss(params, batch) for batch in self.batches]
        # every batch has the same number of tokens: the mean of batch means is the mean over all tokens
        return float(np.mean([np.float64(np.asarray(x.addressable_data(0))) for x in jax.block_until_ready(losses)]))
