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

import dataclasses
import fnmatch
import math
import warnings
from collections.abc import Mapping

from flax import nnx

from jaxdist.tp.call_log import CallLog, path_key
from jaxdist.tp.column_locality import check_column_layer
from jaxdist.tp.placement import (  # noqa: F401
    LINEAR,
    Equation,
    Placement,
    column,
    replicated,
    row,
    vocab,
    weight_name,
)
from jaxdist.tp.vocab_loss import VocabShardedLogits, cross_entropy  # noqa: F401  (a plan's loss)


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
        """(split dim or None, groups) of the parameter at `param_path` by `Placement.split_dim`; the
        engine reads the plan resolved on the model instead (`resolve`), which knows every layer type."""
        placement = self.placement(param_path[:-1])
        if placement is None:
            return None, 1
        return placement.split_dim(str(param_path[-1]), ndim), placement.groups

    def _warn_of_undivided_head_counts(self, modules, layers: dict, size: int) -> None:
        """Warn of a head count (an int attribute named like `n_heads`) of a module holding column layers
        that the plan does not divide: a model reshaping by it, `q.reshape(b, t, self.n_heads, -1)`, would
        group each rank's features into heads of the wrong width and train on without an error."""
        by_path = {tuple(path): module for path, module in modules if isinstance(module, nnx.Module)}
        warned = set()
        for layer in layers.values():
            if layer.kind != "column" or layer.placement.gather_output or layer.placement.loss_parallel:
                continue
            if layer.equation is not None and len(layer.equation.outputs()) > 1:
                continue  # an axis of heads of its own (nnx.MultiHeadAttention's): heads come by shape
            path = tuple(layer.path.split("/"))
            for cut in range(len(path) - 1, 0, -1):
                owner = by_path.get(tuple(int(p) if p.isdigit() else p for p in path[:cut]))
                if owner is None:
                    continue
                divided = self.divided(path[:cut])
                # one warning per rule the fix would be: blocks/*/attn, not one per layer
                where = "/".join("*" if p.isdigit() else p for p in path[:cut])
                for attr, value in vars(owner).items():
                    counts = isinstance(value, int) and not isinstance(value, bool) and _counts_heads(attr)
                    if counts and attr not in divided and value % size == 0 and (where, attr) not in warned:
                        warned.add((where, attr))
                        warnings.warn(
                            f"TPPlan: {where}.{attr}={value} counts heads of column layers split over tp={size}, "
                            f"but the plan does not divide it: code reshaping by it would give each rank wrong "
                            f"heads; add divide={{{where!r}: ({attr!r},)}}, or ignore this if the model takes "
                            "head counts from its arrays",
                            stacklevel=3,
                        )

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
        used, layers, placed = set(), {}, {}
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
            layers[path_key(path)] = _resolve_layer("/".join(map(str, path)), module, placement, size, equation)
            placed[path_key(path)] = module
        unused = sorted(set(self.layers) - used)
        if unused:
            raise ValueError(f"TPPlan: rules {unused} match no module of the model; check the paths")
        self._warn_of_undivided_head_counts(modules, layers, size)
        resolved = ResolvedPlan(self, layers)
        if calls is not None:
            resolved.check_chains(calls)
            probed: set = set()
            for key, layer in layers.items():
                module, avals = placed[key], calls.arguments(key)
                check_column_layer(layer.path, module, layer, size, self.divided(key), avals, probed)
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


def _counts_heads(attr: str) -> bool:
    """n_heads, num_kv_heads, num_attention_heads, n_head (GPT-2's), not head_dim."""
    name = attr.lower()
    return name.endswith("heads") or name in ("n_head", "num_head")


def _annotation(var: nnx.Variable) -> tuple:
    """The logical axis names a parameter was annotated with (empty without)."""
    meta = var.get_metadata()
    names = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding") or ()
    return tuple(names)


def _weight_split(module, split: dict) -> bool:
    """Whether a parameter of two or more dimensions is among the annotated splits."""
    return any(getattr(getattr(module, k), "ndim", 0) >= 2 for k in split)


def static_equation(module, ndim: int) -> Equation | None:
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


def _annotated_equation(module, ndim: int) -> Equation | None:
    """The equation of a weight of `ndim` axes, or of `ndim - 1` when `nnx.vmap` stacked the layer (a
    leading layer axis more than its equation). An einsum layer's weight is its equation's second
    operand (as `nnx.Einsum` calls it): so a stacked 'BTD,DF->BTF' does not take the input, whose
    three axes match the stacked weight's, for the weight."""
    text = getattr(module, "einsum_str", None)
    if isinstance(text, str) and not isinstance(module, (nnx.Linear, nnx.LinearGeneral)):
        second = text.replace(" ", "").replace("...", ".").split("->")[0].split(",")[-1]
        found = [e for n in (ndim, ndim - 1) if (e := Equation.parse(text, n)) is not None]
        return next((e for e in found if e.w == second), found[0] if found else None)
    if isinstance(module, nnx.LinearGeneral):
        return _linear_general_equation(module, ndim) or _linear_general_equation(module, ndim - 1)
    return static_equation(module, ndim)


def _placement_from_split(where: str, module, split: dict) -> Placement:
    """The placement whose split dims (counted from the end) are the annotated ones, or raise."""
    if isinstance(module, nnx.Embed) and split == {"embedding": [-2]}:
        return vocab()
    param = weight_name(module) if not isinstance(module, nnx.Embed) else None
    dims = split.get(param) if param is not None else None
    others = {k: d for k, d in split.items() if k not in (param, "bias")}
    weight = getattr(module, param) if param is not None else None
    if dims is not None and len(dims) == 1 and not others:
        equation = _annotated_equation(module, weight.ndim)
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

    def split_axis(self) -> tuple[int, int] | None:
        """(the split axis's size, the size of the feature axes after it): one rank's block of features,
        seen from the end, whatever leading feature axes the model indexes away before the next layer."""
        features = self.features()
        if features is None or self.letter not in features:
            return None
        after = features[features.index(self.letter) + 1 :]
        return self.shape[self.dim], math.prod(self.shape[self.equation.w.index(c)] for c in after)

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
    param = placement.param or weight_name(module)
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
    equation = equation or static_equation(module, len(shape))
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
        return self.layers.get(path_key(module_path))

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
        warned: set = set()
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
                    if len(columns) == 1:  # (several: e.g. a parallel block's q/k/v and MLP, not all read here)
                        _warn_of_fused_parts(columns[0], layer, warned)
                    columns = []


def _feature_count(layer: Layer) -> int | None:
    """The features from the split axis on (a leading axis the model indexes away, as the 3 of a
    LinearGeneral to (3, heads, head_dim), is not split across)."""
    split = layer.split_axis()
    return split[0] * split[1] if split is not None else None


def _warn_of_fused_parts(col: Layer, reader: Layer, warned: set) -> None:
    """A column making k times the features its row reads, split in other than k groups: a fused
    projection (q/k/v, SwiGLU's gate and up) whose parts lie one after another is then split across
    parts, each rank holding q and half of k, and trains on silently. Only warned of: parts
    interleaved per head (Megatron's, GPT-NeoX's layout) are split right by contiguous pieces."""
    made, read, groups = _feature_count(col), _feature_count(reader), col.placement.groups
    if made is None or read is None or made == groups * read or made % read or made == read:
        return
    pattern = "/".join("*" if p.isdigit() else p for p in col.path.split("/"))
    if pattern in warned:
        return
    warned.add(pattern)
    k = made // read
    warnings.warn(
        f"TPPlan: column layer {pattern} makes {k}x the features its row layer reads ({made} against {read}) "
        f"but is split in {groups} group(s): if it fuses {k} equal parts one after another (q, k, v), each "
        f"rank gets pieces of two parts; split each part: column(groups={k}) (parts of unequal sizes, as "
        "grouped-query q/k/v, need layers of their own; leave it if its parts interleave per head, as "
        "Megatron's and GPT-NeoX's do)",
        stacklevel=4,
    )


def _check_chain(unit: str, col: Layer, reader: Layer) -> None:
    a, b = col.outer(), reader.outer()
    if a is None or b is None or a == b:
        return
    # the column's output keeps its feature axes apart (an einsum's or LinearGeneral's): the model may
    # index a leading one away first (a fused q/k/v's 3, MaxText's fused_qkv), so the pieces line up
    # where both split the same axis, seen from the end
    if col.split_axis() == reader.split_axis():
        return
    raise ValueError(
        f"TPPlan: in {unit}, column layer {col.path} splits {col.describe()} but row layer {reader.path}, which reads "
        f"its output, splits {reader.describe()}: the pieces do not line up (a rank would read another rank's "
        "features); split the same features on both, e.g. heads with heads: column(dim=...) / row(dim=...)"
    )
