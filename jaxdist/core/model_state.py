"""A model as its static definition, its parameters, and the rest of its variables (the model state).

Strategies train the parameters (`nnx.Param`). Every other variable (RNG stream keys and
counters, BatchNorm statistics, constants) is the model state: an explicit
input and output of the traced step, stored in the train state as plain
arrays (RNG keys as their key data). Nothing is mutated across a trace level,
and a checkpoint of the train state resumes dropout and statistics exactly.

The step runs the model in train mode. Each data rank folds its rank index and
the step into every RNG key, so ranks draw different dropout masks and a
resumed run draws the masks of an uninterrupted one. BatchNorm normalizes by
its rank's local batch (PyTorch DDP without SyncBatchNorm); the running
statistics it updates are averaged over the data ranks, so the stored state
stays replicated.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist import comm
from jaxdist.compat import model_sharding_dropped


def training_copy(model: nnx.Module) -> nnx.Module:
    """A copy of `model` in train mode (dropout on, batch statistics updated), without the intermediates
    it has sown (`drop_intermediates`); `model` is not changed."""
    clone = nnx.clone(model)
    clone.train()
    drop_intermediates(clone)
    return clone


def drop_intermediates(model: nnx.Module, unread: str | None = None) -> None:
    """Remove what `model` has sown (`nnx.Intermediate`, e.g. attention weights kept for a look, or an
    auxiliary loss): values of one forward, not state a step carries to the next. A loss that uses them
    reads them with `nnx.pop(model, nnx.Intermediate)` after calling the model; whatever it leaves is
    dropped after each forward, so the train state keeps its shape (sowing appends to a tuple).
    `unread`: what sowed them where no loss can read them (a block the unit engine runs apart from
    the loss): dropping them is then warned of, since an auxiliary loss sown there would be lost."""
    sown = nnx.pop(model, nnx.Intermediate)
    if unread is not None and jax.tree.leaves(sown):
        variables = jax.tree_util.tree_leaves_with_path(sown, is_leaf=lambda x: isinstance(x, nnx.Variable))
        names = ", ".join(repr(jax.tree_util.keystr(path, simple=True, separator="/")) for path, _ in variables)
        # (the same text for every block: Python shows it once, not once per layer)
        warnings.warn(
            f"{unread} sows {names} (nnx.Intermediate), which no loss can read: the unit engine runs the "
            "embed and each block apart from the loss and drops what they sow; return an auxiliary loss "
            "through the activations, or train the model with DDP, whose loss sees the whole model",
            stacklevel=2,
        )


def split_params(model: nnx.Module, who: str) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """`(graphdef, params, rest)` of `model`; a model without an `nnx.Param` raises: a strategy would
    run it and report a loss while training nothing (e.g. weights declared as `nnx.Variable`)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if not jax.tree.leaves(params):
        raise ValueError(
            f"{who}: the model has no nnx.Param, so nothing would train; declare the trained weights as "
            "nnx.Param (an nnx.Variable is state the step carries but does not train)"
        )
    return graphdef, jax.tree.map(strong, params), rest


def strong(x):
    """`x` without JAX's weak type (a parameter made from a Python scalar, `nnx.Param(jnp.array(0.9))`,
    is weakly typed until the first update makes it strong): the train state keeps one type from the
    start, so the second step runs the first step's program (not a retrace, and a program whose
    residuals are ordered as the first's)."""
    return jnp.asarray(x, dtype=x.dtype) if isinstance(x, jax.Array) and jax.typeof(x).weak_type else x


def split_for_training(model: nnx.Module, who: str) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """`(graphdef, params, rest)` of `model` in train mode (`split_params`)."""
    return split_params(training_copy(model), who)


def _is_key(x) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


class ModelState:
    """How one module's non-parameter variables are stored as train-state arrays.

    `store`/`load` convert between the `nnx.State` of the variables and a pure
    dict of arrays (RNG keys as key data). `for_step` and `after_step` are the
    per-step rules of the module docstring; they act leaf by leaf, so they also
    apply to a stack of identical blocks' stored states.
    """

    def __init__(self, rest: nnx.State):
        variables = jax.tree.leaves(rest, is_leaf=lambda x: isinstance(x, nnx.Variable))
        self.treedef = jax.tree.structure(rest)
        self.pure_treedef = jax.tree.structure(nnx.to_pure_dict(rest))
        leaves = jax.tree.leaves(rest)
        if len(variables) != len(leaves) or self.pure_treedef.num_leaves != len(leaves):
            raise ValueError("model state: every non-parameter variable must hold exactly one array")
        self.key_impls = [jax.random.key_impl(x) if _is_key(x) else None for x in leaves]
        self.is_batch_stat = [isinstance(v, nnx.BatchStat) for v in variables]
        # written by the forward the same on every rank: the RNG streams' counts (keys are folded per rank),
        # an integer batch statistic (a count of batches seen; the float ones are averaged)
        self.same_on_ranks = [isinstance(v, nnx.RngState | nnx.BatchStat) for v in variables]

    @property
    def empty(self) -> bool:
        return not self.key_impls

    def store(self, rest: nnx.State) -> dict:
        leaves = [jax.random.key_data(x) if _is_key(x) else x for x in jax.tree.leaves(rest)]
        return self.pure_treedef.unflatten(leaves)

    def load(self, stored: dict) -> nnx.State:
        leaves = [
            x if impl is None else jax.random.wrap_key_data(x, impl=impl)
            for x, impl in zip(jax.tree.leaves(stored), self.key_impls, strict=True)
        ]
        return self.treedef.unflatten(leaves)

    def for_step(self, stored: dict, rank: jax.Array, step: jax.Array) -> dict:
        """The state one data rank's forward starts from: every RNG key folded with `step` and `rank`."""

        def fold(x, impl):
            if impl is None:
                return x
            key = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(x, impl=impl), step), rank)
            return jax.random.key_data(key)

        leaves = [fold(x, impl) for x, impl in zip(jax.tree.leaves(stored), self.key_impls, strict=True)]
        return self.pure_treedef.unflatten(leaves)

    def after_step(self, before: dict, after: dict, axes, token, backend: str | None = None, check_written=True):
        """What the step stores: keys as they were (the fold is per step), floating batch statistics averaged
        over the data `axes`, every other variable (an integer batch statistic such as a count of batches
        seen included: no mean of it is an integer) as the forward left it. Such a variable the forward
        writes (`check_written`: where that can be seen) is warned of: its value may differ by rank."""
        out, written = [], []
        paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(before)[0]]
        leaves = jax.tree.leaves(before), jax.tree.leaves(after)
        zipped = zip(paths, *leaves, self.key_impls, self.is_batch_stat, self.same_on_ranks, strict=True)
        for path, old, new, impl, batch_stat, same in zipped:
            if impl is not None:
                new = old
            elif batch_stat and jnp.issubdtype(new.dtype, jnp.inexact):
                new, token = comm.all_reduce(new, axes, token, op="mean", backend=backend)
            elif new is not old and not same:
                written.append(jax.tree_util.keystr(path, simple=True, separator="/"))
            out.append(new)
        if written and check_written:  # (a forward under jax.checkpoint returns every variable anew: unknown)
            _warn_of_rank_state(written)
        return self.pure_treedef.unflatten(out), token

    def after_local_step(self, before: dict, after: dict) -> dict:
        """`after_step` over data axes of size 1, without collectives: a mean over one rank is its value."""
        leaves = zip(jax.tree.leaves(before), jax.tree.leaves(after), self.key_impls, strict=True)
        return self.pure_treedef.unflatten([old if impl is not None else new for old, new, impl in leaves])

    def apply(
        self,
        graphdef: nnx.GraphDef,
        params,
        stored: dict,
        fn: Callable[[nnx.Module], Any],
        fixed=None,
        unread: str | None = None,
    ):
        """`fn(model)` on the model merged inside the current trace; returns `(out, stored after fn)`.

        `fixed` maps top-level names to variables this state leaves out (e.g. blocks that `fn` never
        runs): they complete the model and are dropped from the result. What `fn` leaves sown is dropped
        (`drop_intermediates`, which `unread` is passed to).
        """
        fixed = fixed or {}
        with model_sharding_dropped():  # the model runs per device: its own sharding annotations are no-ops
            return self._apply(graphdef, params, stored, fn, fixed, unread)

    def _apply(self, graphdef, params, stored, fn, fixed, unread):
        model = nnx.merge(graphdef, params, nnx.State({**self.load(stored), **fixed}))
        out = fn(model)
        drop_intermediates(model, unread)
        after = nnx.split(model, nnx.Param, ...)[2]
        return out, self.store(nnx.State({k: v for k, v in after.items() if k not in fixed}))


def _warn_of_rank_state(names: list[str]) -> None:
    # (the same text for every trace: Python shows it once)
    warnings.warn(
        f"the forward updates the model variables {', '.join(repr(n) for n in names)}, which are neither "
        "parameters nor nnx.BatchStat: under data parallelism each rank keeps the value its own part of the "
        "batch gives (a running mean of its rows, a count of its rows) and the checkpoint holds the first "
        "rank's; make a running statistic an nnx.BatchStat (averaged over the ranks after each step); a value "
        "that does not depend on the data (a count of steps) is the same on every rank",
        stacklevel=3,
    )


def keep_if(skipped: jax.Array, new, old):
    """`old` where the step was skipped, else `new` (leaf by leaf)."""
    return jax.tree.map(lambda n, o: jnp.where(skipped, o, n), new, old)
