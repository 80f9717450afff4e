"""Tensor-parallel plans: which of a model's layers split over the `tp` axis, and how, as data.

A plan maps module paths of an NNX model (patterns such as ``"blocks/*/fc"``,
one ``*`` per path component) to a placement, in the manner of torchtitan's
``parallelize_module`` plans:

* ``column()``: an ``nnx.Linear``-like layer whose output features split over
  ``tp`` (kernel and bias along their last dimension). ``groups=k`` splits
  each of ``k`` equal parts of the output (a fused q/k/v projection), and
  ``gather_output=True`` all-gathers the output (a head whose logits the
  model's own loss reads whole).
* ``row()``: input features split (kernel along its first dimension); the
  partial products are summed over ``tp`` before the (replicated) bias.
* ``vocab()``: an ``nnx.Embed`` whose table rows (the vocabulary) split; its
  lookup sums over ``tp`` and its ``attend`` (a tied head) is column parallel.
* everything not matched is replicated.

``divide`` names static attributes to divide by the tp size in matched
modules (``{"blocks/*": ("n_heads",)}``): the model's own code then runs on
one rank's heads, so its reshapes must derive sizes from that attribute or
from the arrays, never from a global width.

Nothing here copies a model's forward: `bind` re-types the matched layers of
a rank's local model so that their own ``__call__`` runs between the
plan's collectives. Splitting and joining parameters derive from the plan.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdist import tp as tp_math


@dataclasses.dataclass(frozen=True)
class Placement:
    """How one layer splits over `tp`: `kind` is "column", "row", "vocab" or "replicated"."""

    kind: str
    groups: int = 1
    gather_output: bool = False
    loss_parallel: bool = False

    def __post_init__(self):
        if self.kind not in ("column", "row", "vocab", "replicated"):
            raise ValueError(f"Placement kind must be column, row, vocab or replicated, got {self.kind!r}")
        if self.loss_parallel and (self.gather_output or self.kind not in ("column", "vocab")):
            raise ValueError("Placement: loss_parallel is for a column head or a vocab embedding's attend, ungathered")
        if not isinstance(self.groups, int) or self.groups < 1:
            raise ValueError(f"Placement groups must be an int >= 1, got {self.groups!r}")

    def split_dim(self, param: str, ndim: int) -> int | None:
        """The dimension of parameter `param` (a name such as "kernel") split over tp, or None."""
        if self.kind == "column" and param in ("kernel", "bias"):
            return ndim - 1
        if self.kind == "row" and param == "kernel":
            return 0
        if self.kind == "vocab" and param == "embedding":
            return 0
        return None


def column(groups: int = 1, gather_output: bool = False, loss_parallel: bool = False) -> Placement:
    """Output features split over tp (Megatron's column-parallel linear).

    `gather_output` all-gathers the output over tp; `loss_parallel` (a head) keeps each rank's
    slice of the logits for `cross_entropy` below, so whole logits never exist on one rank.
    """
    return Placement("column", groups, gather_output, loss_parallel)


def row() -> Placement:
    """Input features split over tp, partial products summed (Megatron's row-parallel linear)."""
    return Placement("row")


def vocab(loss_parallel: bool = False) -> Placement:
    """Embedding rows split over tp (vocabulary-parallel embedding; `attend`, a tied head, is column
    parallel: its logits gathered, or with `loss_parallel` kept per rank for `cross_entropy`)."""
    return Placement("vocab", loss_parallel=loss_parallel)


# -- a loss over logits split along the vocabulary ---------------------------------------------
# A head bound with `loss_parallel` returns its logits wrapped: only `cross_entropy` unwraps them,
# and it reduces only per-token scalars over tp. Any other use of the wrapper (an attribute such as
# .ndim, arithmetic, a jnp function, optax's loss, numpy) raises, since one rank's slice of the
# logits read as whole logits would be silently wrong.

_MISUSE = (
    "TP plan: these logits are this rank's vocabulary slice (loss_parallel=True); only "
    "jaxdist.tp_plan.cross_entropy(logits, labels) reads them. Compute the loss with it, or gather "
    "the logits (gather_output=True, or loss_parallel=False on a vocab embedding) to use them otherwise"
)


class VocabShardedLogits:
    """Logits split along the vocabulary over tp, as a loss-parallel head returns them."""

    __slots__ = ("_logits", "_binding")

    def __init__(self, logits: jax.Array, binding: Binding):
        self._logits, self._binding = logits, binding

    def _refuse(self, *args, **kwargs):
        raise ValueError(_MISUSE)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):  # protocol probes (copy, pickle) find nothing
            raise AttributeError(name)
        raise ValueError(_MISUSE)

    __jax_array__ = __array__ = __array_function__ = __array_ufunc__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __pow__ = __rpow__ = __matmul__ = __rmatmul__ = _refuse
    __getitem__ = __neg__ = __pos__ = __abs__ = __iter__ = __len__ = __bool__ = __float__ = __int__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = _refuse
    __hash__ = object.__hash__

    @property
    def shape(self):
        return self._logits.shape

    @property
    def dtype(self):
        return self._logits.dtype


def _refuse_flatten(logits: VocabShardedLogits):
    raise ValueError(_MISUSE)


# a jitted function (most jnp functions) flattens its arguments before reading them
jax.tree_util.register_pytree_node(VocabShardedLogits, _refuse_flatten, lambda aux, children: None)


def cross_entropy(logits, labels: jax.Array) -> jax.Array:
    """Per-token softmax cross-entropy with integer labels, in float32 (optax's on one device).

    Under a TP plan whose head is `column(loss_parallel=True)` (or `vocab(loss_parallel=True)` for a
    tied `attend`), `logits` are this rank's vocabulary slice and the loss is computed without
    gathering them (`jaxdist.tp.vocab_parallel_cross_entropy`).
    """
    if isinstance(logits, VocabShardedLogits):
        b = logits._binding
        return tp_math.vocab_parallel_cross_entropy(logits._logits, labels, b.axis, backend=b.backend)
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)


def replicated() -> Placement:
    return Placement("replicated")


def _matches(pattern: str, path: tuple) -> bool:
    parts = pattern.strip("/").split("/")
    return len(parts) == len(path) and all(fnmatch.fnmatchcase(str(p), q) for p, q in zip(path, parts, strict=True))


@dataclasses.dataclass(frozen=True)
class TPPlan:
    """Module path patterns -> placements, and static attributes divided by the tp size."""

    layers: Mapping[str, Placement]
    divide: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def placement(self, module_path: tuple) -> Placement | None:
        hits = [p for pattern, p in self.layers.items() if _matches(pattern, module_path)]
        if len(hits) > 1:
            raise ValueError(f"TPPlan: module {'/'.join(map(str, module_path))} matches more than one rule")
        return hits[0] if hits else None

    def divided(self, module_path: tuple) -> tuple[str, ...]:
        hits = [attrs for pattern, attrs in self.divide.items() if _matches(pattern, module_path)]
        if len(hits) > 1:
            raise ValueError(f"TPPlan: module {'/'.join(map(str, module_path))} matches more than one divide rule")
        return tuple(hits[0]) if hits else ()

    def param_split(self, param_path: tuple, ndim: int) -> tuple[int | None, int]:
        """(split dim or None, groups) of the parameter at `param_path` (module path + name)."""
        placement = self.placement(param_path[:-1])
        if placement is None:
            return None, 1
        return placement.split_dim(str(param_path[-1]), ndim), placement.groups

    def check(self, model: nnx.Module, size: int, modules=None) -> None:
        """Raise if a rule matches nothing, a matched module cannot take its placement, or a size
        does not divide by `size`. `modules`: the (path, module) pairs to check instead of
        `nnx.iter_graph(model)` (the engine passes a stacked module as one layer)."""
        used = set()
        for path, module in nnx.iter_graph(model) if modules is None else modules:
            if not isinstance(module, nnx.Module):
                continue
            placement = self.placement(path)
            if placement is not None:
                used.update(p for p in self.layers if _matches(p, path))
                _check_module(path, module, placement, size)
            for attr in self.divided(path):
                value = getattr(module, attr, None)
                if not isinstance(value, int) or value % size:
                    raise ValueError(
                        f"TPPlan: {'/'.join(map(str, path))}.{attr}={value!r} must be an int divisible by tp={size}"
                    )
        unused = sorted(set(self.layers) - used)
        if unused:
            raise ValueError(f"TPPlan: rules {unused} match no module of the model; check the paths")

    @classmethod
    def from_annotations(
        cls,
        model: nnx.Module,
        rules,
        *,
        axis: str = "tp",
        divide: Mapping[str, tuple[str, ...]] | None = None,
        overrides: Mapping[str, Placement] | None = None,
    ) -> TPPlan:
        """A plan from the model's own sharding annotations (`nnx.with_partitioning(init, names)`).

        `rules` maps the annotations' logical axis names to mesh axes (a dict, or the
        `(name, mesh axis)` pairs of `nnx.logical_axis_rules`); names mapped to `axis` split
        over tp. A layer with a `kernel` whose output axis (last) maps to tp is column
        parallel, whose input axis (second to last) maps to tp is row parallel; an
        `nnx.Embed` whose table's vocabulary axis maps to tp is vocab parallel. Any other
        parameter axis mapped to tp raises (no placement splits it). Annotations carry no
        static attributes nor whether a column layer's output must be gathered: pass
        `divide` and `overrides` (rules that replace the derived ones they match, e.g.
        `{"head": column(gather_output=True)}`). A layer axis added by `nnx.vmap` is skipped
        (axes count from the end).
        """
        table = dict(rules)

        def on_tp(name) -> bool:
            target = table.get(name, name) if name is not None else None
            return axis in (target if isinstance(target, (tuple, list)) else (target,))

        overrides = dict(overrides or {})
        layers: dict[str, Placement] = {}
        for path, module in nnx.iter_graph(model):
            if not isinstance(module, nnx.Module) or not path:
                continue
            where = "/".join(map(str, path))
            params = {k: v for k, v in vars(module).items() if isinstance(v, nnx.Param)}
            split = {k: [i for i, n in enumerate(_annotation(v)) if on_tp(n)] for k, v in params.items()}
            split = {k: [i - len(_annotation(params[k])) for i in dims] for k, dims in split.items() if dims}
            if not split or any(_matches(p, path) for p in overrides):
                continue
            placement = _placement_from_split(where, module, split)
            layers[where] = placement
        return cls({**layers, **overrides}, dict(divide or {}))


def _annotation(var: nnx.Variable) -> tuple:
    """The logical axis names a parameter was annotated with (empty without)."""
    meta = var.get_metadata()
    names = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding") or ()
    return tuple(names)


def _placement_from_split(where: str, module, split: dict) -> Placement:
    """The placement whose split dims (counted from the end) are the annotated ones, or raise."""
    if isinstance(module, nnx.Embed) and split == {"embedding": [-2]}:
        return vocab()
    candidates = {"column": {"kernel": [-1], "bias": [-1]}, "row": {"kernel": [-2]}}
    for kind, dims in candidates.items():
        if "kernel" in split and all(dims.get(k) == d for k, d in split.items()):
            return Placement(kind)
    detail = ", ".join(f"{k} axes {d}" for k, d in split.items())
    raise ValueError(
        f"TPPlan.from_annotations: {where} ({type(module).__name__}) maps {detail} (from the end) to tp, "
        "which no placement splits (column: kernel's last axis, row: its second to last, vocab: an "
        "nnx.Embed's vocabulary axis); change the annotation or pass overrides={path: placement}"
    )


def _check_module(path, module, placement: Placement, size: int) -> None:
    where = "/".join(map(str, path))
    if placement.kind in ("column", "row"):
        if not isinstance(getattr(module, "kernel", None), nnx.Param):
            raise ValueError(f"TPPlan: {where} is {placement.kind} parallel but has no `kernel` parameter")
        kernel = module.kernel[...]
        dim = kernel.ndim - 1 if placement.kind == "column" else 0
        if kernel.shape[dim] % (size * placement.groups):
            raise ValueError(
                f"TPPlan: {where}: kernel dimension {dim} of size {kernel.shape[dim]} must divide by "
                f"tp x groups = {size} x {placement.groups}"
            )
    elif placement.kind == "vocab":
        if not isinstance(module, nnx.Embed):
            raise ValueError(f"TPPlan: {where} is vocab parallel but is a {type(module).__name__}, not an nnx.Embed")
        if module.num_embeddings % size:
            raise ValueError(f"TPPlan: {where}: vocabulary {module.num_embeddings} must divide by tp={size}")


# -- storage: each rank's piece contiguous ---------------------------------------------


def to_storage(x, dim: int | None, groups: int, size: int):
    """Reorder `x` along `dim` so that tp rank r's piece is the r-th contiguous chunk (a no-op
    unless `groups > 1`, where rank r holds the r-th part of every group)."""
    return _swap_blocks(x, dim, groups, size)


def from_storage(x, dim: int | None, groups: int, size: int):
    """The inverse of `to_storage`."""
    return _swap_blocks(x, dim, size, groups)


def _swap_blocks(x, dim: int | None, outer: int, inner: int):
    """View dimension `dim` as (outer, inner, rest) and swap the first two."""
    if dim is None or outer == 1 or inner == 1:
        return x
    shape = x.shape
    y = x.reshape(*shape[:dim], outer, inner, shape[dim] // (outer * inner), *shape[dim + 1 :])
    return jnp.swapaxes(y, dim, dim + 1).reshape(shape)


def split(x, dim: int | None, groups: int, rank: int, size: int):
    """Rank `rank`'s piece of the full parameter `x` (for tests and conversions)."""
    if dim is None:
        return x
    x = np.asarray(to_storage(jnp.asarray(x), dim, groups, size))
    n = x.shape[dim] // size
    return np.take(x, np.arange(rank * n, (rank + 1) * n), axis=dim)


# -- binding: the model's own layers between the plan's collectives -----------------------


@dataclasses.dataclass(frozen=True)
class Binding:
    """What `bind` needs to know about the run: the tp axis, its size, the comm backend and
    whether activations between layers are split along a token dimension, `sequence_dim`
    (sequence parallelism)."""

    axis: str
    size: int
    backend: str | None = None
    sequence_parallel: bool = False
    sequence_dim: int = 1

    def enter(self, x):
        """Into a column-parallel layer: all the tokens; backward sums over tp."""
        if self.sequence_parallel:
            return tp_math.gather_sequence(x, self.axis, self.backend, self.sequence_dim)
        return tp_math.copy_to_tp(x, self.axis, self.backend)

    def leave(self, partial):
        """Out of a row-parallel layer: summed over tp (reduce-scattered along the token dim)."""
        if self.sequence_parallel:
            return tp_math.scatter_sequence(partial, self.axis, self.backend, self.sequence_dim)
        return tp_math.reduce_from_tp(partial, self.axis, self.backend)


class _NoBias:
    """A view of a linear layer without its bias, so the layer's own `__call__` computes x @ W."""

    def __init__(self, module):
        object.__setattr__(self, "_module", module)

    def __getattr__(self, name):
        if name == "bias":
            return None
        if name == "use_bias":
            return False
        return getattr(self._module, name)


def _check_features(self, x, kind: str) -> None:
    """A plan whose layers do not chain (a row layer fed whole activations, a column or replicated layer
    fed one rank's features) is an error naming the layer, not a shape error inside its matmul."""
    kernel = getattr(self, "kernel", None)
    if getattr(kernel, "ndim", None) != 2 or not hasattr(x, "shape") or x.shape[-1] == kernel.shape[0]:
        return  # (in, out) kernels only: a convolution's or an einsum's say less
    size = self._jaxdist_tp.size
    if kind == "row":
        want = "this rank's 1/tp of the features, from a column layer (gather_output=False) before it"
    else:
        want = "whole activations (as after a row layer, or gathered), not one rank's features"
    placed = "replicated: the plan places no rule on it" if kind == "replicated" else f"{kind} parallel"
    raise ValueError(
        f"TPPlan: {self._jaxdist_path} ({placed}) gets {x.shape[-1]} input features where its kernel piece "
        f"takes {kernel.shape[0]} (tp={size}); its input must be {want}: check the plan's column/row pairs"
    )


def _column_call(self, x, *args, **kwargs):
    b: Binding = self._jaxdist_tp
    _check_features(self, x, "column")
    y = type(self).__mro__[1].__call__(self, b.enter(x), *args, **kwargs)
    if self._jaxdist_loss_parallel:
        return VocabShardedLogits(y, b)
    return gather_features(y, b.axis, b.backend) if self._jaxdist_gather else y


def _row_call(self, x, *args, **kwargs):
    b: Binding = self._jaxdist_tp
    _check_features(self, x, "row")
    y = b.leave(type(self).__mro__[1].__call__(_NoBias(self), x, *args, **kwargs))
    bias = getattr(self, "bias", None)
    if bias is None:
        return y
    return y + jnp.reshape(bias[...], (1,) * (y.ndim - 1) + (-1,)).astype(y.dtype)


def _replicated_call(self, x, *args, **kwargs):
    _check_features(self, x, "replicated")
    return type(self).__mro__[1].__call__(self, x, *args, **kwargs)


def _vocab_call(self, tokens, *args, **kwargs):
    b: Binding = self._jaxdist_tp
    (table,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)
    return tp_math.vocab_parallel_embed(tokens, table, b.axis, backend=b.backend)


def _vocab_attend(self, query, *args, **kwargs):
    b: Binding = self._jaxdist_tp
    logits = type(self).__mro__[1].attend(self, b.enter(query), *args, **kwargs)
    if self._jaxdist_loss_parallel:
        return VocabShardedLogits(logits, b)
    return gather_features(logits, b.axis, b.backend)


@functools.cache
def _bound_class(cls: type, kind: str) -> type:
    members = {
        "column": {"__call__": _column_call},
        "row": {"__call__": _row_call},
        "replicated": {"__call__": _replicated_call},
        "vocab": {"__call__": _vocab_call, "attend": _vocab_attend},
    }[kind]
    return type(f"TP{kind.capitalize()}{cls.__name__}", (cls,), members)


def bind(module: nnx.Module, plan: TPPlan, binding: Binding, prefix: tuple = ()) -> None:
    """Make the layers of a rank's local `module` (whose parameters are this rank's pieces) run
    tensor parallel: matched layers get the plan's collectives around their own `__call__`, the
    replicated `nnx.Linear`s a check of their input's features, and the plan's divided attributes
    are divided. `prefix` is `module`'s path in the whole model."""
    for path, sub in list(nnx.iter_graph(module)):
        if not isinstance(sub, nnx.Module):
            continue
        full = (*prefix, *path)
        for attr in plan.divided(full):
            object.__setattr__(sub, attr, getattr(sub, attr) // binding.size)
        placement = plan.placement(full)
        replicated = placement is None or placement.kind == "replicated"
        if replicated and not isinstance(sub, nnx.Linear):
            continue
        object.__setattr__(sub, "_jaxdist_tp", binding)
        object.__setattr__(sub, "_jaxdist_path", "/".join(map(str, full)))
        if replicated:  # checked only: a replicated linear layer fed one rank's features (a column without its row)
            sub.__class__ = _bound_class(type(sub), "replicated")
            continue
        object.__setattr__(sub, "_jaxdist_gather", placement.gather_output)
        object.__setattr__(sub, "_jaxdist_loss_parallel", placement.loss_parallel)
        sub.__class__ = _bound_class(type(sub), placement.kind)


def _local_last(g, axis):
    n = g.shape[-1] // jax.lax.psum(1, axis)
    return jax.lax.dynamic_slice_in_dim(g, jax.lax.axis_index(axis) * n, n, axis=g.ndim - 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gather_features(x, axis: str, backend: str | None = None):
    """All-gather the last dimension over `axis` in forward; in backward every rank holds the
    whole (identical) gradient, so each keeps its own slice (Megatron's gather_output)."""
    return tp_math.gather_whole(x, axis, x.ndim - 1, backend)


gather_features.defvjp(
    lambda x, axis, backend: (tp_math.gather_whole(x, axis, x.ndim - 1, backend), None),
    lambda axis, backend, _, g: (_local_last(g, axis),),
)
