"""Tensor-parallel plans: which of a model's layers split over the `tp` axis, and how, as data.

A plan maps module paths of an NNX model (patterns such as ``"blocks/*/fc"``,
one ``*`` per path component) to a placement, in the manner of torchtitan's
``parallelize_module`` plans:

* ``column(dim=None, param=None)``: a layer whose output features split over
  ``tp``: its weight along ``dim``, its bias along the matching output axis.
  ``groups=k`` splits each of ``k`` equal parts of that dimension (a fused
  q/k/v projection), and ``gather_output=True`` all-gathers the output (a head
  whose logits the model's own loss reads whole).
* ``row(dim=None, param=None)``: input features split (the weight along
  ``dim``, a contracted axis); the partial products are summed over ``tp``
  before the (replicated) bias.
* ``vocab()``: an ``nnx.Embed`` whose table rows (the vocabulary) split; its
  lookup sums over ``tp`` and its ``attend`` (a tied head) is column parallel.
* everything not matched is replicated.

The weight is ``param`` (default: ``kernel``, else the layer's one ``nnx.Param``
of two or more dimensions). ``dim`` is an index into it (negative counts from
the end) or an axis name: a letter of the layer's einsum equation (an
``nnx.Einsum``'s ``einsum_str``, an ``einsum_str`` attribute, or an equation
string the layer is called with) or a name of its ``nnx.with_partitioning``
annotation. By default it is what the layer's type implies: an ``nnx.Linear``
splits its kernel's last dimension (column) or first (row); an einsum layer
its first output axis (column: heads in ``'BTD,DNH->BTNH'``) or its first
contracted one (row: heads in ``'BTNH,NHD->BTD'``). A weight of more than two
dimensions whose equation is unknown needs ``dim``.

``divide`` names static attributes to divide by the tp size in matched
modules (``{"blocks/*": ("n_heads",)}``): the model's own code then runs on
one rank's heads, so its reshapes must derive sizes from that attribute or
from the arrays, never from a global width.

``prepare`` resolves the plan on the model (`TPPlan.resolve`), from one trace
of the model's calls as on one device: it checks each layer and size, and that
every run of column layers followed by a row layer (a chain) splits the same
features: each column's output pieces must be the pieces the row reads (heads
with heads, not head_dim with heads), else it raises, naming both layers.

Nothing here copies a model's forward: `bind` re-types the matched layers of
a rank's local model so that their own ``__call__`` (and ``attend``) runs: for
a subclass of ``nnx.Linear``, ``nnx.Einsum`` or ``nnx.Embed`` the base
class's computation it reaches through ``super()`` becomes the parallel one
(a subclass that never reaches it raises); any other layer runs whole on its
pieces between the plan's collectives. Splitting and joining parameters
derive from the resolved plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdist.tp import layers as tp_math


@dataclasses.dataclass(frozen=True)
class Placement:
    """How one layer splits over `tp`: `kind` is "column", "row", "vocab" or "replicated"; `dim` and
    `param` name the weight and its split dimension (None: the layer type's default)."""

    kind: str
    groups: int = 1
    gather_output: bool = False
    loss_parallel: bool = False
    dim: int | str | None = None
    param: str | None = None

    def __post_init__(self):
        if self.kind not in ("column", "row", "vocab", "replicated"):
            raise ValueError(f"Placement kind must be column, row, vocab or replicated, got {self.kind!r}")
        if self.loss_parallel and (self.gather_output or self.kind not in ("column", "vocab")):
            raise ValueError("Placement: loss_parallel is for a column head or a vocab embedding's attend, ungathered")
        if not isinstance(self.groups, int) or self.groups < 1:
            raise ValueError(f"Placement groups must be an int >= 1, got {self.groups!r}")
        if self.dim is not None and not isinstance(self.dim, (int, str)):
            raise ValueError(f"Placement dim must be an int, an axis name or None, got {self.dim!r}")
        if (self.dim is not None or self.param is not None) and self.kind not in ("column", "row"):
            raise ValueError(f"Placement: dim and param are for column and row layers, not {self.kind}")

    def split_dim(self, param: str, ndim: int) -> int | None:
        """The dimension of parameter `param` split over tp, by the names and dims of an `nnx.Linear` or an
        `nnx.Embed` (a layer of another kind or weight name: `TPPlan.resolve` on the model)."""
        dim = self.dim if isinstance(self.dim, int) else None
        if self.kind == "column" and param in (self.param or "kernel", "bias"):
            return ndim - 1 if dim is None or param == "bias" else dim % ndim
        if self.kind == "row" and param == (self.param or "kernel"):
            return 0 if dim is None else dim % ndim
        if self.kind == "vocab" and param == "embedding":
            return 0
        return None


def column(
    groups: int = 1,
    gather_output: bool = False,
    loss_parallel: bool = False,
    *,
    dim: int | str | None = None,
    param: str | None = None,
) -> Placement:
    """Output features split over tp (Megatron's column-parallel linear).

    `dim`: the weight's split dimension, an output axis (index or axis name; default: the layer
    type's, see the module docstring); `param`: the weight's name. `gather_output` all-gathers the
    output over tp; `loss_parallel` (a head) keeps each rank's slice of the logits for
    `cross_entropy` below, so whole logits never exist on one rank.
    """
    return Placement("column", groups, gather_output, loss_parallel, dim, param)


def row(dim: int | str | None = None, *, param: str | None = None) -> Placement:
    """Input features split over tp, partial products summed (Megatron's row-parallel linear); `dim`
    (a contracted axis of the weight) and `param` as for `column`."""
    return Placement("row", dim=dim, param=param)


def vocab(loss_parallel: bool = False) -> Placement:
    """Embedding rows split over tp (vocabulary-parallel embedding; `attend`, a tied head, is column
    parallel: its logits gathered, or with `loss_parallel` kept per rank for `cross_entropy`)."""
    return Placement("vocab", loss_parallel=loss_parallel)


def replicated() -> Placement:
    return Placement("replicated")


# -- a loss over logits split along the vocabulary ---------------------------------------------
# A head bound with `loss_parallel` returns its logits wrapped: only `cross_entropy` unwraps them,
# and it reduces only per-token scalars over tp. Any other use of the wrapper (an attribute such as
# .ndim, arithmetic, a jnp function, optax's loss, numpy) raises, since one rank's slice of the
# logits read as whole logits would be silently wrong.

_MISUSE = (
    "TP plan: these logits are this rank's vocabulary slice (loss_parallel=True); only "
    "jaxdist.tp.plan.cross_entropy(logits, labels) reads them. Compute the loss with it, or gather "
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


def _matches(pattern: str, path: tuple) -> bool:
    parts = pattern.strip("/").split("/")
    return len(parts) == len(path) and all(fnmatch.fnmatchcase(str(p), q) for p, q in zip(path, parts, strict=True))


def _key(path) -> tuple:
    return tuple(map(str, path))


# -- einsum equations: which of a weight's axes are output features, which contracted --------


@dataclasses.dataclass(frozen=True)
class Equation:
    """A two-operand einsum `x,w->out` of an input and a weight ("." stands for an ellipsis)."""

    x: str
    w: str
    out: str

    @classmethod
    def parse(cls, text: str, weight_ndim: int) -> Equation | None:
        """The equation of `text` with the operand of `weight_ndim` axes as the weight (the second
        one when both fit), or None if it is not such an equation."""
        text = text.replace(" ", "").replace("...", ".")
        if text.count("->") != 1 or text.count(",") != 1:
            return None
        ins, out = text.split("->")
        x, w = ins.split(",")
        if len(w) != weight_ndim or "." in w:
            x, w = w, x
        if len(w) != weight_ndim or "." in w or not w.isalpha():
            return None
        return cls(x, w, out)

    def outputs(self) -> str:
        """The weight's output feature axes in output order: those after the output's first axis it
        shares with the input (a leading stacked axis, as q/k/v's 3 in 'BTD,SNDH->SBTNH', is none)."""
        shared = [i for i, c in enumerate(self.out) if c == "." or c in self.x]
        tail = self.out[shared[0] + 1 :] if shared else self.out
        return "".join(c for c in tail if c in self.w and c not in self.x)

    def contracted(self) -> str:
        """The weight's axes summed with the input's, in the input's order."""
        return "".join(c for c in self.x if c in self.w and c not in self.out)

    def out_axis(self, letter: str) -> int:
        """The output axis of `letter` (negative when it follows an ellipsis)."""
        i = self.out.index(letter)
        return i - len(self.out) if "." in self.out[:i] else i

    def x_axis(self, letter: str) -> int:
        i = self.x.index(letter)
        return i - len(self.x) if "." in self.x[:i] else i


LINEAR = Equation(".i", "io", ".o")  # nnx.Linear: a kernel (in, out) on the last axis of the input


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
        """(split dim or None, groups) of the parameter at `param_path` by `Placement.split_dim`; the
        engine reads the plan resolved on the model instead (`resolve`), which knows every layer type."""
        placement = self.placement(param_path[:-1])
        if placement is None:
            return None, 1
        return placement.split_dim(str(param_path[-1]), ndim), placement.groups

    def check(self, model: nnx.Module, size: int, modules=None) -> None:
        """Raise if a rule matches nothing, a matched module cannot take its placement, or a size
        does not divide by `size` (`resolve` without the layers' calls)."""
        self.resolve(list(nnx.iter_graph(model)) if modules is None else modules, size)

    def resolve(self, modules, size: int, calls: CallLog | None = None) -> ResolvedPlan:
        """The plan on a model: each placed layer's weight, split dimension and features.

        `modules`: the model's `(path, module)` pairs (`nnx.iter_graph`; the engine passes a stacked
        module as one layer). `calls`: the placed layers' calls in one trace of the model (`CallLog`):
        their equations (a default dimension may need one) and order, whose column -> row chains
        must split the same features. Raises on a rule that matches nothing, a module that cannot
        take its placement, a size that does not divide by `size`, or a chain that does not line up.
        """
        used, layers = set(), {}
        for path, module in modules:
            if not isinstance(module, nnx.Module):
                continue
            placement = self.placement(path)
            for attr in self.divided(path):
                value = getattr(module, attr, None)
                if not isinstance(value, int) or value % size:
                    raise ValueError(
                        f"TPPlan: {'/'.join(map(str, path))}.{attr}={value!r} must be an int divisible by tp={size}"
                    )
            if placement is None:
                continue
            used.update(p for p in self.layers if _matches(p, path))
            if placement.kind == "replicated":
                continue
            equation = calls.equation(path) if calls is not None else None
            layers[_key(path)] = _resolve_layer("/".join(map(str, path)), module, placement, size, equation)
        unused = sorted(set(self.layers) - used)
        if unused:
            raise ValueError(f"TPPlan: rules {unused} match no module of the model; check the paths")
        resolved = ResolvedPlan(self, layers)
        if calls is not None:
            resolved.check_chains(calls)
        return resolved

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
        over tp. A layer whose weight (`kernel`, else its one parameter of two or more
        dimensions) has one axis mapped to tp is column parallel where that axis is an output
        feature, row parallel where it is contracted: an `nnx.Linear`'s last and first axes, an
        einsum layer's (an `einsum_str`) output and contracted axes; other weights of two
        dimensions read as (in, out). An `nnx.Embed` whose vocabulary axis maps to tp is vocab
        parallel. A one-dimensional parameter alone mapped to tp (a norm's scale) stays
        replicated; any other parameter axis mapped to tp raises (no placement splits it).
        Annotations carry no static attributes nor whether a column layer's output must be
        gathered: pass `divide` and `overrides` (rules that replace the derived ones they
        match, e.g. `{"head": column(gather_output=True)}`). A layer axis added by `nnx.vmap`
        is skipped (axes count from the end).
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
            if all(len(_annotation(params[k])) == 1 for k in split) and not _weight_split(module, split):
                continue  # a norm's scale (or another vector) alone on tp: replicated
            layers[where] = _placement_from_split(where, module, split)
        return cls({**layers, **overrides}, dict(divide or {}))


def _annotation(var: nnx.Variable) -> tuple:
    """The logical axis names a parameter was annotated with (empty without)."""
    meta = var.get_metadata()
    names = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding") or ()
    return tuple(names)


def _weight_split(module, split: dict) -> bool:
    """Whether a parameter of two or more dimensions is among the annotated splits."""
    return any(getattr(getattr(module, k), "ndim", 0) >= 2 for k in split)


def _static_equation(module, ndim: int) -> Equation | None:
    """The weight's equation as the layer's type or attributes say it, before any call."""
    if isinstance(module, nnx.Linear):
        return LINEAR
    if isinstance(module, nnx.LinearGeneral):
        return _linear_general_equation(module, ndim)
    text = getattr(module, "einsum_str", None)
    if isinstance(text, str):
        return Equation.parse(text, ndim)
    return LINEAR if ndim == 2 else None


def _linear_general_equation(module: nnx.LinearGeneral, ndim: int) -> Equation | None:
    """An `nnx.LinearGeneral` contracting the input's trailing axes: kernel (in..., out...)."""
    n_in, n_out = len(module.in_features), len(module.out_features)
    if module.batch_axis or ndim != n_in + n_out or tuple(module.axis) != tuple(range(-n_in, 0)):
        return None
    letters = "IJKLMNOPQRSTUVWXYZ"[: n_in + n_out]
    return Equation("." + letters[:n_in], letters, "." + letters[n_in:])


def _placement_from_split(where: str, module, split: dict) -> Placement:
    """The placement whose split dims (counted from the end) are the annotated ones, or raise."""
    if isinstance(module, nnx.Embed) and split == {"embedding": [-2]}:
        return vocab()
    param = _weight_name(module) if not isinstance(module, nnx.Embed) else None
    dims = split.get(param) if param is not None else None
    others = {k: d for k, d in split.items() if k not in (param, "bias")}
    weight = getattr(module, param) if param is not None else None
    if dims is not None and len(dims) == 1 and not others:
        ndim = weight.ndim  # a stacked layer's weight has a leading layer axis more than its equation
        equation = _static_equation(module, ndim)
        if equation is None and isinstance(getattr(module, "einsum_str", None), str):
            equation = Equation.parse(module.einsum_str, ndim - 1)
        if equation is not None and -len(equation.w) <= dims[0]:
            letter = equation.w[dims[0]]
            kind = "column" if letter in equation.outputs() else "row" if letter in equation.contracted() else None
            bias = split.get("bias")
            if kind == "row" and bias:
                kind = None
            if kind is not None:
                dim = None if isinstance(module, nnx.Linear) else dims[0]
                return Placement(kind, dim=dim, param=None if param == "kernel" else param)
        elif equation is None:
            raise ValueError(
                f"TPPlan.from_annotations: {where} ({type(module).__name__}) maps {param} axis {dims[0]} (from the "
                "end) to tp, but its equation is known only when it is called, so output and input axes cannot "
                f"be told apart; pass overrides={{{where!r}: column(dim=..., param={param!r})}} (or row(...))"
            )
    detail = ", ".join(f"{k} axes {d}" for k, d in split.items())
    raise ValueError(
        f"TPPlan.from_annotations: {where} ({type(module).__name__}) maps {detail} (from the end) to tp, "
        "which no placement splits (column: a weight's output axis, row: a contracted axis, vocab: an "
        "nnx.Embed's vocabulary axis); change the annotation or pass overrides={path: placement}"
    )


def _weight_name(module) -> str | None:
    """`kernel`, else the module's one parameter of two or more dimensions, else None."""
    if isinstance(getattr(module, "kernel", None), nnx.Param):
        return "kernel"
    found = [k for k, v in vars(module).items() if isinstance(v, nnx.Param) and v.ndim >= 2]
    return found[0] if len(found) == 1 else None


# -- a placed layer resolved on the model ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layer:
    """One placed layer on the model: its placement, weight, split dimension and (when known) equation."""

    path: str
    placement: Placement
    param: str
    shape: tuple  # the whole weight's (without a stacked layer axis)
    dim: int
    equation: Equation | None
    bias_dim: int | None = None  # a column layer's bias, along its split output axis

    @property
    def kind(self) -> str:
        return self.placement.kind

    @property
    def letter(self) -> str | None:
        return self.equation.w[self.dim] if self.equation is not None else None

    def features(self) -> str | None:
        """The weight axes (letters) of the features this split partitions, in their flattened order."""
        if self.equation is None:
            return None
        return self.equation.outputs() if self.kind == "column" else self.equation.contracted()

    def outer(self) -> int | None:
        """How many interleaved blocks each rank's piece of the flattened features is (1: contiguous)."""
        features = self.features()
        if features is None or self.letter not in features:
            return None
        return math.prod(self.shape[self.equation.w.index(c)] for c in features[: features.index(self.letter)])

    def describe(self) -> str:
        letter = f" ({self.letter})" if self.letter else ""
        outer = self.outer()
        how = (
            "" if outer is None else ", contiguous pieces" if outer == 1 else f", pieces in {outer} interleaved blocks"
        )
        return f"{self.param} {self.shape} along dim {self.dim}{letter}{how}"


def _resolve_layer(where: str, module, placement: Placement, size: int, called: str | None) -> Layer:
    if placement.kind == "vocab":
        if not isinstance(module, nnx.Embed):
            raise ValueError(f"TPPlan: {where} is vocab parallel but is a {type(module).__name__}, not an nnx.Embed")
        if module.num_embeddings % size:
            raise ValueError(f"TPPlan: {where}: vocabulary {module.num_embeddings} must divide by tp={size}")
        return Layer(where, placement, "embedding", tuple(module.embedding.shape), 0, None)
    param = placement.param or _weight_name(module)
    weight = getattr(module, param, None) if param is not None else None
    if not isinstance(weight, nnx.Param) or getattr(weight, "ndim", 0) < 1:
        if placement.param is not None:
            raise ValueError(f"TPPlan: {where} is {placement.kind} parallel but has no parameter {param!r}")
        raise ValueError(
            f"TPPlan: {where} ({type(module).__name__}) is {placement.kind} parallel but has no `kernel` parameter "
            f"nor one weight of two or more dimensions; name it: {placement.kind}(param=...)"
        )
    shape = tuple(weight.shape)
    equation = Equation.parse(called, len(shape)) if called else None
    equation = equation or _static_equation(module, len(shape))
    dim = _split_dim(where, placement, param, weight, shape, equation)
    if shape[dim] % (size * placement.groups):
        raise ValueError(
            f"TPPlan: {where}: {param} dimension {dim} of size {shape[dim]} must divide by "
            f"tp x groups = {size} x {placement.groups}"
        )
    bias_dim = _bias_dim(where, module, dim, shape, equation) if placement.kind == "column" else None
    return Layer(where, placement, param, shape, dim, equation, bias_dim)


def _split_dim(where: str, placement: Placement, param: str, weight, shape: tuple, equation) -> int:
    kind, ndim = placement.kind, len(shape)
    features = None
    if equation is not None:
        features = equation.outputs() if kind == "column" else equation.contracted()
    what = "output" if kind == "column" else "contracted (input)"
    dim = placement.dim
    if dim is None:
        if not features:
            raise ValueError(
                f"TPPlan: {where}: cannot tell which axis of {param} {shape} holds its {what} features (no einsum "
                f"equation is known for it); name it: {kind}(dim=...)"
            )
        return equation.w.index(features[0])
    if isinstance(dim, str):
        names = _annotation(weight)
        if dim in names:
            dim = names.index(dim)
        elif equation is not None and dim in equation.w:
            dim = equation.w.index(dim)
        else:
            raise ValueError(
                f"TPPlan: {where}: {kind}(dim={dim!r}) names no axis of {param} {shape} (its annotation: "
                f"{names or None}, its equation's weight: {equation.w if equation else None})"
            )
    if not -ndim <= dim < ndim:
        raise ValueError(f"TPPlan: {where}: {kind}(dim={placement.dim!r}) is out of range for {param} {shape}")
    dim %= ndim
    if features is not None and equation.w[dim] not in features:
        raise ValueError(
            f"TPPlan: {where}: {kind}(dim={placement.dim!r}) splits axis {dim} ({equation.w[dim]}) of {param} "
            f"{shape}, which is not among the {what} axes {list(features)} of its equation "
            f"{equation.x},{equation.w}->{equation.out}; a {kind} layer splits its {what} features"
        )
    return dim


def _bias_dim(where: str, module, dim: int, shape: tuple, equation) -> int | None:
    """The axis of a column layer's bias that holds the weight's split output axis."""
    bias = getattr(module, "bias", None)
    if not isinstance(bias, nnx.Param):
        return None
    if equation is not None:
        letters = [c for c in equation.out if c in equation.w]  # nnx.Einsum broadcasts its bias so
        if len(letters) == bias.ndim:
            return letters.index(equation.w[dim])
        if equation.outputs() and len(equation.outputs()) == bias.ndim:
            return equation.outputs().index(equation.w[dim])
    if bias.ndim == 1 and bias.shape[0] == shape[dim]:
        return 0
    raise ValueError(
        f"TPPlan: {where}: cannot tell which axis of its bias {tuple(bias.shape)} holds the split output axis "
        f"{dim} of its weight {shape}"
    )


@dataclasses.dataclass(frozen=True)
class ResolvedPlan:
    """A plan on one model (`TPPlan.resolve`): its placed layers by path, as `bind` and the engine read them."""

    plan: TPPlan
    layers: Mapping[tuple, Layer]

    def layer(self, module_path: tuple) -> Layer | None:
        return self.layers.get(_key(module_path))

    def placement(self, module_path: tuple) -> Placement | None:
        return self.plan.placement(module_path)

    def divided(self, module_path: tuple) -> tuple[str, ...]:
        return self.plan.divided(module_path)

    def param_split(self, param_path: tuple, ndim: int) -> tuple[int | None, int]:
        """(split dim or None, groups) of the parameter at `param_path` (module path + name)."""
        layer = self.layer(param_path[:-1])
        if layer is None:
            return None, 1
        name = str(param_path[-1])
        if name == layer.param:
            return layer.dim, layer.placement.groups
        if name == "bias" and layer.kind == "column" and layer.bias_dim is not None:
            return layer.bias_dim, layer.placement.groups
        return None, 1

    def check_chains(self, calls: CallLog) -> None:
        """Each run of column layers (outputs split, not gathered) and the row layer after it, in the order
        a unit calls them, must split the same features: every rank's column pieces are the row's."""
        for unit, paths in calls.units().items():
            columns: list[Layer] = []
            for path in paths:
                layer = self.layers.get(path)
                if layer is None:
                    continue
                if layer.kind == "column" and not (layer.placement.gather_output or layer.placement.loss_parallel):
                    columns.append(layer)
                elif layer.kind == "row":
                    for col in columns:
                        _check_chain(unit, col, layer)
                    columns = []


def _check_chain(unit: str, col: Layer, row: Layer) -> None:
    a, b = col.outer(), row.outer()
    if a is None or b is None or a == b:
        return
    raise ValueError(
        f"TPPlan: in {unit}, column layer {col.path} splits {col.describe()} but row layer {row.path}, which reads "
        f"its output, splits {row.describe()}: the pieces do not line up (a rank would read another rank's "
        "features); split the same features on both, e.g. heads with heads: column(dim=...) / row(dim=...)"
    )


# -- the placed layers' calls in one trace of the model ----------------------------------------


class CallLog:
    """Records, per unit, the placed layers a trace calls, in order, and the equation each is called with."""

    def __init__(self, plan: TPPlan):
        self.plan = plan
        self._unit = "the model"
        self._calls: list[tuple[str, tuple, str | None]] = []

    @contextlib.contextmanager
    def unit(self, name: str):
        """Calls inside are the unit `name`'s."""
        self._unit, before = name, self._unit
        try:
            yield
        finally:
            self._unit = before

    def watch(self, module: nnx.Module, prefix: tuple = ()) -> nnx.Module:
        """Re-type the placed layers of `module` (at path `prefix` in the model) to record their calls."""
        for path, sub in list(nnx.iter_graph(module)):
            full = (*prefix, *path)
            if isinstance(sub, nnx.Module) and self.plan.placement(full) is not None:
                object.__setattr__(sub, "_jaxdist_log", (self, _key(full)))
                sub.__class__ = _recording_class(type(sub))
        return module

    def record(self, path: tuple, equation: str | None) -> None:
        self._calls.append((self._unit, path, equation))

    def equation(self, module_path: tuple) -> str | None:
        """The equation the layer was first called with, if it was called with one."""
        key = _key(module_path)
        return next((eq for _, p, eq in self._calls if p == key and eq), None)

    def units(self) -> dict[str, list[tuple]]:
        out: dict[str, list[tuple]] = {}
        for unit, path, _ in self._calls:
            out.setdefault(unit, []).append(path)
        return out


def _call_equation(module, args, kwargs) -> str | None:
    """The einsum equation a layer is called with: an `einsum_str` argument or attribute, or any string
    argument with `->` (a layer called as `layer("BTD,DNH->BTNH", x)`)."""
    for value in (kwargs.get("einsum_str"), *args, *kwargs.values(), getattr(module, "einsum_str", None)):
        if isinstance(value, str) and "->" in value:
            return value
    return None


def _recording_call(self, *args, **kwargs):
    log, path = self._jaxdist_log
    log.record(path, _call_equation(self, args, kwargs))
    return type(self).__mro__[1].__call__(self, *args, **kwargs)


@functools.cache
def _recording_class(cls: type) -> type:
    return type(f"Recording{cls.__name__}", (cls,), {"__call__": _recording_call})


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
    """A view of a layer without its bias, so the layer's own code computes the product alone."""

    def __init__(self, module):
        object.__setattr__(self, "_module", module)

    def __getattr__(self, name):
        if name == "bias":
            return None
        if name == "use_bias":
            return False
        return getattr(self._module, name)


def _equation_now(self, called: str | None) -> Equation | None:
    """The equation of this call of a placed or checked layer (its weight's local shape)."""
    layer: Layer | None = getattr(self, "_jaxdist_layer", None)
    param = layer.param if layer is not None else _weight_name(self)
    weight = getattr(self, param, None) if param is not None else None
    ndim = getattr(weight, "ndim", None)
    if ndim is None:
        return None
    return (Equation.parse(called, ndim) if called else None) or _static_equation(self, ndim)


def _check_features(self, x, kind: str, equation: Equation | None) -> None:
    """A plan whose layers do not chain (a row layer fed whole activations, a column or replicated layer
    fed one rank's features) is an error naming the layer, not a shape error inside its matmul."""
    layer: Layer | None = getattr(self, "_jaxdist_layer", None)
    param = layer.param if layer is not None else _weight_name(self)
    weight = getattr(self, param, None) if param is not None else None
    if weight is None or equation is None or not hasattr(x, "shape"):
        return
    kernel = weight[...]
    for c in equation.contracted():
        i, j = equation.x_axis(c), equation.w.index(c)
        if -x.ndim <= i < x.ndim and x.shape[i] != kernel.shape[j]:
            break
    else:
        return
    size = self._jaxdist_tp.size
    if kind == "row":
        want = "this rank's 1/tp of the features, from a column layer (gather_output=False) before it"
    else:
        want = "whole activations (as after a row layer, or gathered), not one rank's features"
    placed = "replicated: the plan places no rule on it" if kind == "replicated" else f"{kind} parallel"
    got = tuple(x.shape[equation.x_axis(c)] for c in equation.contracted())
    takes = tuple(kernel.shape[equation.w.index(c)] for c in equation.contracted())
    got, takes = (got[0], takes[0]) if len(got) == 1 else (got, takes)
    raise ValueError(
        f"TPPlan: {self._jaxdist_path} ({placed}) gets {got} input features where its {param} piece "
        f"takes {takes} (tp={size}); its input must be {want}: check the plan's column/row pairs"
    )


def _column_out(self, y, equation: Equation | None):
    """A column layer's output: kept split, wrapped for the vocabulary-parallel loss, or gathered."""
    b: Binding = self._jaxdist_tp
    layer: Layer = self._jaxdist_layer
    axis = equation.out_axis(equation.w[layer.dim]) if equation is not None else -1
    axis %= y.ndim
    if layer.placement.loss_parallel:
        if axis != y.ndim - 1:
            raise ValueError(
                f"TPPlan: {layer.path} is column(loss_parallel=True) but its split axis is output axis {axis} of "
                f"{y.ndim}; the vocabulary-parallel loss reads the vocabulary along the last axis"
            )
        return VocabShardedLogits(y, b)
    return gather_features(y, b.axis, b.backend, axis) if layer.placement.gather_output else y


def _reached() -> None:
    if _REACHED:
        _REACHED[-1] = True


_REACHED: list[bool] = []  # per placed call in flight: whether it reached the base class's parallel computation


def _linear_column(self, inputs, *args, **kwargs):
    _reached()
    _check_features(self, inputs, "column", LINEAR)
    y = nnx.Linear.__call__(self, self._jaxdist_tp.enter(inputs), *args, **kwargs)
    return _column_out(self, y, LINEAR)


def _linear_row(self, inputs, *args, **kwargs):
    _reached()
    _check_features(self, inputs, "row", LINEAR)
    y = self._jaxdist_tp.leave(nnx.Linear.__call__(_NoBias(self), inputs, *args, **kwargs))
    bias = getattr(self, "bias", None)
    if bias is None:
        return y
    return y + jnp.reshape(bias[...], (1,) * (y.ndim - 1) + (-1,)).astype(y.dtype)


def _linear_replicated(self, inputs, *args, **kwargs):
    _check_features(self, inputs, "replicated", LINEAR)
    return nnx.Linear.__call__(self, inputs, *args, **kwargs)


def _einsum_text(self, einsum_str):
    return (einsum_str if einsum_str is not None else self.einsum_str).replace(" ", "")


def _einsum_column(self, inputs, einsum_str=None, *args, **kwargs):
    _reached()
    equation = Equation.parse(_einsum_text(self, einsum_str), self.kernel.ndim)
    _check_features(self, inputs, "column", equation)
    y = nnx.Einsum.__call__(self, self._jaxdist_tp.enter(inputs), einsum_str, *args, **kwargs)
    return _column_out(self, y, equation)


def _einsum_row(self, inputs, einsum_str=None, *args, **kwargs):
    _reached()
    text = _einsum_text(self, einsum_str)
    _check_features(self, inputs, "row", Equation.parse(text, self.kernel.ndim))
    y = self._jaxdist_tp.leave(nnx.Einsum.__call__(_NoBias(self), inputs, einsum_str, *args, **kwargs))
    if self.bias is None:
        return y
    shape = self._infer_broadcasted_bias_shape(text, inputs, self.kernel[...])
    return y + jnp.reshape(self.bias[...], shape).astype(y.dtype)


def _einsum_replicated(self, inputs, einsum_str=None, *args, **kwargs):
    equation = Equation.parse(_einsum_text(self, einsum_str), self.kernel.ndim)
    _check_features(self, inputs, "replicated", equation)
    return nnx.Einsum.__call__(self, inputs, einsum_str, *args, **kwargs)


def _embed_lookup(self, inputs, *args, **kwargs):
    _reached()
    b: Binding = self._jaxdist_tp
    (table,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)
    return tp_math.vocab_parallel_embed(inputs, table, b.axis, backend=b.backend)


def _embed_attend(self, query, *args, **kwargs):
    _reached()
    b: Binding = self._jaxdist_tp
    logits = nnx.Embed.attend(self, b.enter(query), *args, **kwargs)
    if self._jaxdist_layer.placement.loss_parallel:
        return VocabShardedLogits(logits, b)
    return gather_features(logits, b.axis, b.backend)


# The base classes whose computation a bound subclass reaches through super(): (base, kind) -> methods.
_PARALLEL = {
    (nnx.Linear, "column"): {"__call__": _linear_column},
    (nnx.Linear, "row"): {"__call__": _linear_row},
    (nnx.Linear, "replicated"): {"__call__": _linear_replicated},
    (nnx.Einsum, "column"): {"__call__": _einsum_column},
    (nnx.Einsum, "row"): {"__call__": _einsum_row},
    (nnx.Einsum, "replicated"): {"__call__": _einsum_replicated},
    (nnx.Embed, "vocab"): {"__call__": _embed_lookup, "attend": _embed_attend},
}


def _base_of(cls: type) -> type | None:
    return next((b for b in (nnx.Linear, nnx.Einsum, nnx.Embed) if issubclass(cls, b)), None)


def _guarded(name: str):
    """The bound class's `name`: the layer's own method, which must reach the base class's parallel one."""

    def method(self, *args, **kwargs):
        _REACHED.append(False)
        try:
            out = getattr(super(type(self), self), name)(*args, **kwargs)
        finally:
            reached = _REACHED.pop()
        if not reached:
            base = _base_of(type(self)).__name__
            raise ValueError(
                f"TPPlan: {self._jaxdist_path} ({type(self).__mro__[1].__name__}) overrides {name} without calling "
                f"nnx.{base}.{name} (super().{name}), where the split computation runs; call it from its own "
                f"{name}, or leave the layer out of the plan"
            )
        return out

    method.__name__ = name
    return method


def _array_arg(args, kwargs):
    """The position (or keyword) of a call's activations: its first array argument."""
    for i, a in enumerate(args):
        if hasattr(a, "shape") and hasattr(a, "dtype"):
            return i
    return next((k for k, a in kwargs.items() if hasattr(a, "shape") and hasattr(a, "dtype")), None)


def _map_arg(args, kwargs, where, fn):
    if isinstance(where, int):
        args = (*args[:where], fn(args[where]), *args[where + 1 :])
    elif where is not None:
        kwargs = {**kwargs, where: fn(kwargs[where])}
    return args, kwargs


def _any_column(self, *args, **kwargs):
    """A layer of another type: its own call, whole, on its pieces after the column's entry."""
    where = _array_arg(args, kwargs)
    equation = _equation_now(self, _call_equation(self, args, kwargs))
    x = args[where] if isinstance(where, int) else kwargs.get(where)
    _check_features(self, x, "column", equation)
    args, kwargs = _map_arg(args, kwargs, where, self._jaxdist_tp.enter)
    return _column_out(self, type(self).__mro__[1].__call__(self, *args, **kwargs), equation)


def _any_row(self, *args, **kwargs):
    where = _array_arg(args, kwargs)
    equation = _equation_now(self, _call_equation(self, args, kwargs))
    _check_features(self, args[where] if isinstance(where, int) else kwargs.get(where), "row", equation)
    y = self._jaxdist_tp.leave(type(self).__mro__[1].__call__(_NoBias(self), *args, **kwargs))
    bias = getattr(self, "bias", None)
    if not isinstance(bias, nnx.Param):
        return y
    return y + jnp.reshape(bias[...], (1,) * (y.ndim - 1) + (-1,)).astype(y.dtype)


@functools.cache
def _parallel_class(base: type, kind: str) -> type:
    return type(f"Parallel{kind.capitalize()}{base.__name__}", (base,), _PARALLEL[(base, kind)])


@functools.cache
def _bound_class(cls: type, kind: str) -> type:
    base = _base_of(cls)
    if (base, kind) in _PARALLEL:
        parallel = _parallel_class(base, kind)
        guards = {} if kind == "replicated" else {name: _guarded(name) for name in _PARALLEL[(base, kind)]}
        bases = (parallel,) if cls is base else (cls, parallel)  # a subclass's own methods first, then these
        return type(f"TP{kind.capitalize()}{cls.__name__}", bases, guards)
    if kind == "vocab":
        raise ValueError(f"TPPlan: a vocab layer must be an nnx.Embed, got {cls.__name__}")
    return type(
        f"TP{kind.capitalize()}{cls.__name__}", (cls,), {"__call__": {"column": _any_column, "row": _any_row}[kind]}
    )


def bind(module: nnx.Module, plan: ResolvedPlan, binding: Binding, prefix: tuple = ()) -> None:
    """Make the layers of a rank's local `module` (whose parameters are this rank's pieces) run
    tensor parallel: placed layers run their own code with the plan's collectives (module
    docstring), replicated `nnx.Linear`s and `nnx.Einsum`s get a check of their input's features,
    and the plan's divided attributes are divided. `plan` is resolved on the model
    (`TPPlan.resolve`); `prefix` is `module`'s path in the whole model."""
    for path, sub in list(nnx.iter_graph(module)):
        if not isinstance(sub, nnx.Module):
            continue
        full = (*prefix, *path)
        for attr in plan.divided(full):
            object.__setattr__(sub, attr, getattr(sub, attr) // binding.size)
        layer = plan.layer(full)
        if layer is None and not isinstance(sub, (nnx.Linear, nnx.Einsum)):
            continue
        object.__setattr__(sub, "_jaxdist_tp", binding)
        object.__setattr__(sub, "_jaxdist_path", "/".join(map(str, full)))
        object.__setattr__(sub, "_jaxdist_layer", layer)
        if isinstance(sub, nnx.Einsum):  # its bias broadcasts by the kernel's shape: this rank's piece
            object.__setattr__(sub, "kernel_shape", tuple(sub.kernel.shape))
        if isinstance(sub, nnx.LinearGeneral):  # its bias reshapes to its output features: this rank's
            shape = tuple(sub.kernel.shape)
            object.__setattr__(sub, "out_features", shape[len(shape) - len(sub.out_features) :])
        # checked only: a replicated layer fed one rank's features (a column without its row)
        sub.__class__ = _bound_class(type(sub), "replicated" if layer is None else layer.kind)


def _local(g, axis, dim):
    n = g.shape[dim] // jax.lax.psum(1, axis)
    return jax.lax.dynamic_slice_in_dim(g, jax.lax.axis_index(axis) * n, n, axis=dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gather_features(x, axis: str, backend: str | None = None, dim: int = -1):
    """All-gather dimension `dim` (default the last) over `axis` in forward; in backward every rank
    holds the whole (identical) gradient, so each keeps its own slice (Megatron's gather_output)."""
    return tp_math.gather_whole(x, axis, dim % x.ndim, backend)


gather_features.defvjp(
    lambda x, axis, backend, dim: (tp_math.gather_whole(x, axis, dim % x.ndim, backend), None),
    lambda axis, backend, dim, _, g: (_local(g, axis, dim % g.ndim),),
)
