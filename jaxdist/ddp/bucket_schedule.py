"""The communication of one DDP step: each bucket's gradient reduction started as soon as its
gradients exist and waited one bucket later (at most two in flight), and under ZeRO-1 each bucket's
parameter gather slotted just before the first equation that reads it (`jaxdist.ddp.interleave`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist import comm
from jaxdist.ddp.buckets import (
    pack_bucket,
    pack_shard,
    unpack_bucket,
)
from jaxdist.ddp.interleave import InterleaveSchedule


class BucketSchedule(InterleaveSchedule):
    """The communication of one DDP step, on one token chain.

    Gradients: bucket b's reduction starts as soon as its gradients exist; the
    oldest pending one is waited when the next starts, and the following
    equation is tied to that wait, so at most two reductions are in flight and
    each overlaps the backward compute between two buckets.
    Parameters (zero1): the gather of the next rank-major bucket in forward
    order starts when the current one is waited, just before its first use.
    A rank-major bucket's gradients are reduce-scattered, a one-segment
    bucket's (plain DDP; zero1's parameters kept whole) all-reduced.
    """

    def __init__(self, run, tok, chunks: list, gather_order, n_stored: int):  # run: the DDPRun
        self.cfg, self.layout = run.cfg, run.layout
        self.first_grad = 2 + n_stored  # the index of the first gradient among the step's outputs
        self.tok = tok
        self.chunks = chunks  # this rank's piece of every parameter (whole where replicated)
        self.accumulated = None
        self.pending: list[tuple[int, Any]] = []
        self.reduced: dict[int, jax.Array] = {}
        self.tie_next = False
        self.gathers: dict[int, Any] = {}
        self.gather_order = gather_order  # buckets in the order the forward first reads them
        self._start_gather(0)

    def _start_gather(self, position: int):
        if position >= len(self.gather_order):
            return
        b = self.gather_order[position]
        bucket, axis, backend = self.layout.buckets[b], self.cfg.axis, self.cfg.backend
        if self.cfg.pack_buckets:
            segment = pack_shard(bucket, self.chunks)  # the copy into the communication buffer
            self.gathers[b], self.tok = comm.all_gather_start(segment, axis, self.tok, tiled=True, backend=backend)
            return
        # one grouped gather over the bucket's chunks in place (one NCCL group with the nccl backend)
        chunks = tuple(self.chunks[slot.leaf] for slot in bucket.slots)
        dims = tuple(slot.dim for slot in bucket.slots)
        handle, self.tok = comm.all_gather_start(chunks, axis, self.tok, axis=dims, tiled=True, backend=backend)
        self.gathers[b] = handle

    def _wait_gather(self, b: int) -> dict[int, jax.Array]:
        started = self.gathers.pop(b)
        if self.cfg.pack_buckets:
            flat, self.tok = comm.wait(started, self.tok)
            gathered = unpack_bucket(self.layout.buckets[b], flat)
        else:
            values, self.tok = comm.wait(started, self.tok)
            gathered = {slot.leaf: v for slot, v in zip(self.layout.buckets[b].slots, values, strict=True)}
        self._start_gather(self.gather_order.index(b) + 1)
        return gathered

    def gather_all(self) -> dict[int, jax.Array]:
        """Every gathered parameter, by leaf index."""
        leaves = {}
        for b in list(self.gather_order):
            leaves.update(self._wait_gather(b))
        return leaves

    def fetch(self, b, ties):
        ties, self.tok = comm.tie(ties, self.tok)  # the gather of the next bucket waits for this compute
        return self._wait_gather(b), ties

    def ready(self, b, values):
        bucket = self.layout.buckets[b]
        grads = {i - self.first_grad: g for i, g in values.items()}
        if self.accumulated is not None:  # the mean over micro-batches, like one big batch
            a = self.cfg.accumulation_steps
            grads = {i: (g + self.accumulated[i]) / np.asarray(a, g.dtype) for i, g in grads.items()}
        dtype = self.cfg.reduce_dtype or bucket.dtype
        op = "mean" if self.cfg.average_in_collective else "sum"

        def scale(x):
            if op == "mean":
                return x
            # by 1/dp in float32 (or wider), rounded once: 1/dp itself rounded to bfloat16 (1/3 -> 0.33398)
            # would scale every gradient up by the same 0.14%
            wide = jnp.promote_types(dtype, jnp.float32)
            return (x.astype(wide) * np.asarray(1 / self.cfg.dp, wide)).astype(dtype)

        axis, backend = self.cfg.axis, self.cfg.backend
        if self.cfg.pack_buckets:
            start = comm.reduce_scatter_start if bucket.sharded else comm.all_reduce_start
            handle, self.tok = start(scale(pack_bucket(bucket, grads, dtype)), axis, self.tok, op=op, backend=backend)
        else:  # one grouped collective over the bucket's gradients in place: no copies in or out
            gs = tuple(scale(grads[slot.leaf].astype(dtype)) for slot in bucket.slots)
            if bucket.sharded:
                dims = tuple(slot.dim for slot in bucket.slots)
                handle, self.tok = comm.reduce_scatter_start(
                    gs, axis, self.tok, op=op, scatter_axis=dims, backend=backend
                )
            else:
                handle, self.tok = comm.all_reduce_start(gs, axis, self.tok, op=op, backend=backend)
        if self.pending:
            self._finish_oldest()
            self.tie_next = True
        self.pending.append((b, handle))

    def _finish_oldest(self):
        b, handle = self.pending.pop(0)
        if self.cfg.pack_buckets:
            self.reduced[b], self.tok = comm.wait(handle, self.tok)
            return
        values, self.tok = comm.wait(handle, self.tok)
        self.reduced[b] = {slot.leaf: v for slot, v in zip(self.layout.buckets[b].slots, values, strict=True)}

    def before(self, inputs):
        if self.tie_next and inputs:
            self.tie_next = False
            inputs, self.tok = comm.tie(inputs, self.tok)
        return inputs

    def drain(self) -> list:
        """Finish every reduction (and any unread gather); the reduced buckets (this rank's segment of
        a rank-major one; unpacked: its gradients by leaf) in bucket order."""
        while self.pending:
            self._finish_oldest()
        while self.gathers:  # waiting one starts the next: a snapshot of the started ones would miss it
            self._wait_gather(next(iter(self.gathers)))
        return [self.reduced[b] for b in range(len(self.layout))]
