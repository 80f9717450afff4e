"""What stops the training loop: NaN/Inf steps in a row, and a stop request (SIGTERM, Ctrl-C) at a step's end."""

from __future__ import annotations

import collections
import os
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.train.checkpoint import Checkpoints
from jaxdist.train.config import TrainConfig
from jaxdist.train.ending import in_multi_process_run
from jaxdist.train.step_watchdog import StopDeadline, stop_grace

NUM_PROCESSES_ENV = "JAXDIST_NUM_PROCESSES"  # set for each worker by `jaxdist launch` (by hand under SLURM)


def host_value(x) -> np.ndarray:
    """A replicated array's value on this host (also in multi-process runs)."""
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


class NonFiniteLoss(RuntimeError):
    """The run stopped: its steps kept having a NaN/Inf loss or gradient (the message is one line)."""


class NonFiniteSteps:
    """Stops the run after `run.max_skipped_steps` consecutive steps with a NaN/Inf loss or gradient (the
    strategies skip those updates, so the state stays the last good one), or at the first NaN/Inf loss of
    a strategy that cannot skip (FSDP's update_in_backward has applied it): before the state is saved.
    The flags are read back in batches, at most `limit` steps behind and never the newest step's, so the
    next step is always queued while the host waits."""

    def __init__(self, cfg: TrainConfig, ckpt: Checkpoints | None):
        self.can_skip = not (cfg.parallel.fsdp > 1 and cfg.parallel.update_in_backward)
        self.limit = cfg.run.max_skipped_steps if self.can_skip else min(1, cfg.run.max_skipped_steps)
        self.lr, self.ckpt = cfg.optim.lr, ckpt
        self.pending: list = []
        self.in_a_row = 0
        self.skipped: list[int] = []  # the steps read back as skipped, in order

    def add(self, step: int, metrics: dict) -> None:
        self.pending.append((step, metrics.get("skipped"), metrics["loss"]))
        if self.limit and len(self.pending) > self.limit:
            self.check(keep_newest=True)

    def skipped_before(self, step: int) -> int:
        """How many steps before `step` (of those read back: every one before a row's) were skipped."""
        return sum(1 for s in self.skipped if s < step)

    def check(self, keep_newest: bool = False) -> None:
        """Count the pending steps (all but the newest with `keep_newest`); raise NonFiniteLoss at the limit."""
        done, self.pending = (self.pending[:-1], self.pending[-1:]) if keep_newest else (self.pending, [])
        for step, skipped, loss in done:
            skipped = skipped is not None and bool(host_value(skipped))
            if skipped:
                self.skipped.append(step)
            if not self.limit:
                continue
            bad = skipped or not np.isfinite(float(host_value(loss)))
            self.in_a_row = self.in_a_row + 1 if bad else 0
            if self.in_a_row >= self.limit > 0:
                self.pending = []
                raise NonFiniteLoss(self._message(step))

    def _message(self, step: int) -> str:
        kept = f"; the checkpoints in {self.ckpt.directory} hold the last good state" if self.ckpt else ""
        if not self.can_skip:
            what = "its loss is NaN/Inf and parallel.update_in_backward=true has already applied its update"
        else:
            what = f"{self.in_a_row} steps in a row had a NaN/Inf loss or gradient and were skipped"
        return (
            f"stopped at step {step}: {what} (run.max_skipped_steps={self.limit}); lower optim.lr "
            f"(now {self.lr:g}) or check the data{kept}"
        )


class StopRequests:
    """SIGTERM (a scheduler's stop) and a first Ctrl-C ask the loop to stop at the next step boundary,
    where it saves: an interrupt then never lands inside a checkpoint save. A second one interrupts
    at once. In a multi-process run a process that cannot reach the boundary (blocked in a collective
    for a peer that is gone) ends itself after a grace period (`StopDeadline`); a single process has no
    peer to wait for (a step that hangs there is `run.step_timeout_s`'s).

    The processes of a run stop at one boundary (`StopVotes`): a signal reaches them at different moments
    (a scheduler's SIGTERM to each node, one process's Ctrl-C), and each stopping at its own step left
    both waiting for the other's collectives until the grace period killed them, the save lost."""

    def __init__(self):
        self.requested = False
        self.previous = {}
        self.deadline = None
        self.last_check = None
        self.votes = StopVotes() if in_multi_process_run() else None
        if threading.current_thread() is threading.main_thread():  # signal handlers belong to the main thread
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
            if _with_peers():
                self.deadline = StopDeadline(stop_grace())

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        when = "after this step" if self.votes is None else "in a few steps, at a step all processes agree on"
        print(f"\njaxdist: stopping {when} (again to stop at once)", file=sys.stderr, flush=True)

    def at_end(self) -> None:
        """The loop ended on its own: a stop asked for meanwhile gets the grace period again for the last save."""
        if self.requested and self.deadline is not None:
            self.deadline.restart()

    def check(self) -> None:
        """At a step boundary: stop here if asked to. The time since the previous boundary (a step, with its
        logging, evaluation or save) lengthens the grace period to match."""
        now = time.monotonic()
        if self.deadline is not None and self.last_check is not None:
            self.deadline.allow(now - self.last_check)
        self.last_check = now
        if self.votes is not None:
            self.votes.cast(self.requested)
        if self.requested and self.deadline is not None:  # a boundary reached: not stuck (the vote's steps, the
            self.deadline.restart()  # save's turn: the host's boundary, the device may lag)
        stop = self.requested if self.votes is None else self.votes.decided()  # (in step with the other processes)
        if stop:
            if self.votes is not None and not self.requested:
                print("\njaxdist: another process is stopping; stopping with it", file=sys.stderr, flush=True)
            raise KeyboardInterrupt

    def close(self) -> None:
        if self.deadline is not None:
            self.deadline.close()
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class StopVotes:
    """Whether any process of the run was asked to stop, decided alike on every process: at each boundary
    each casts its own answer into an all-reduce over every device, dispatched behind the step (no wait),
    and reads the result cast `LAG` boundaries before. The reductions run in the same order on every
    process, so all read the same answers at the same boundary and stop there; a host never waits for a
    word its peers could only give after a step it holds up (a wait in the key-value store deadlocked
    against a peer's host waiting on that step's results)."""

    LAG = 2  # boundaries between a vote and its reading: the device has long finished the small reduction

    def __init__(self):
        devices = jax.devices()
        mesh = jax.sharding.Mesh(np.array(devices), ("all",))
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("all"))
        local = [d for d in devices if d.process_index == jax.process_index()]

        def ballot(stop: int):  # this process's vote on each of its devices, made once
            pieces = [jax.device_put(np.array([stop], np.int32), d) for d in local]
            return jax.make_array_from_single_device_arrays((len(devices),), sharding, pieces)

        self.ballots = (ballot(0), ballot(1))
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self.reduce = jax.jit(lambda x: jnp.max(x), out_shardings=replicated)
        self.cast_votes: collections.deque = collections.deque()

    def cast(self, stop: bool) -> None:
        self.cast_votes.append(self.reduce(self.ballots[int(stop)]))  # a dispatch: no transfer, no wait

    def decided(self) -> bool:
        """Whether the vote of `LAG` boundaries ago says stop (False until there is one)."""
        if len(self.cast_votes) <= self.LAG:
            return False
        return bool(host_value(self.cast_votes.popleft()))


def _with_peers() -> bool:
    """Whether this process is one of several: a jax.distributed run, or a worker of `jaxdist launch`."""
    return in_multi_process_run() or int(os.environ.get(NUM_PROCESSES_ENV) or 1) > 1
