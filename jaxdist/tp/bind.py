"""Binding a resolved plan: the model's own layers re-typed so that their `__call__` (and `attend`)
runs between the plan's collectives on one rank's pieces (`bind`), and the feature gathers they use."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist.tp import layers as tp_math
from jaxdist.tp.call_log import call_equation
from jaxdist.tp.placement import LINEAR, Equation
from jaxdist.tp.plan import Layer, ResolvedPlan, static_equation, weight_name
from jaxdist.tp.row_linearity import WithoutBias
from jaxdist.tp.vocab_loss import VocabShardedLogits


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


def _equation_now(self, called: str | None) -> Equation | None:
    """The equation of this call of a placed or checked layer (its weight's local shape)."""
    layer: Layer | None = getattr(self, "_jaxdist_layer", None)
    param = layer.param if layer is not None else weight_name(self)
    weight = getattr(self, param, None) if param is not None else None
    ndim = getattr(weight, "ndim", None)
    if ndim is None:
        return None
    return (Equation.parse(called, ndim) if called else None) or static_equation(self, ndim)


def _check_features(self, x, kind: str, equation: Equation | None) -> None:
    """A plan whose layers do not chain (a row layer fed whole activations, a column or replicated layer
    fed one rank's features) is an error naming the layer, not a shape error inside its matmul."""
    layer: Layer | None = getattr(self, "_jaxdist_layer", None)
    param = layer.param if layer is not None else weight_name(self)
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
    y = self._jaxdist_tp.leave(nnx.Linear.__call__(WithoutBias(self), inputs, *args, **kwargs))
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
    y = self._jaxdist_tp.leave(nnx.Einsum.__call__(WithoutBias(self), inputs, einsum_str, *args, **kwargs))
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
        except (TypeError, ValueError) as e:
            if str(e).startswith(("TPPlan", "Parallel")):  # jaxdist's own word on it
                raise
            raise _own_code_failed(self, name, e, reached=_REACHED[-1]) from e
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


def _own_code_failed(layer, name: str, e: Exception, reached: bool) -> ValueError:
    """A placed subclass's own code failing on this rank's pieces: say which layer, and the likely cause."""
    cls, base = type(layer).__mro__[1].__name__, _base_of(type(layer)).__name__
    where = f"TPPlan: {layer._jaxdist_path} ({cls}, a subclass of nnx.{base})"
    cause = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if reached:
        return ValueError(
            f"{where}: its own {name} failed around super().{name}, whose result is this tp rank's slice ({cause}); "
            "a part of the layer jaxdist does not split (a LoRA branch, a second weight) met that slice: make that "
            "part a layer of its own in the plan, or leave this layer out of it"
        )
    return ValueError(
        f"{where}: its own {name} failed before calling super().{name} ({cause}); jaxdist splits the weight for "
        f"nnx.{base}.{name}, so a layer reading its weight itself (a transposed kernel) meets this rank's slice: "
        f"call super().{name}, or leave the layer out of the plan"
    )


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
    equation = _equation_now(self, call_equation(self, args, kwargs))
    x = args[where] if isinstance(where, int) else kwargs.get(where)
    _check_features(self, x, "column", equation)
    args, kwargs = _map_arg(args, kwargs, where, self._jaxdist_tp.enter)
    return _column_out(self, type(self).__mro__[1].__call__(self, *args, **kwargs), equation)


def _any_row(self, *args, **kwargs):
    where = _array_arg(args, kwargs)
    equation = _equation_now(self, call_equation(self, args, kwargs))
    _check_features(self, args[where] if isinstance(where, int) else kwargs.get(where), "row", equation)
    y = self._jaxdist_tp.leave(type(self).__mro__[1].__call__(WithoutBias(self), *args, **kwargs))
    bias = getattr(self, "bias", None)
    if not isinstance(bias, nnx.Variable):  # what WithoutBias hid (a frozen bias too), added once after the sum
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


_NORMS = (nnx.LayerNorm, nnx.RMSNorm)


def _normalizes_last_axis(norm) -> bool:
    axes = {getattr(norm, "reduction_axes", -1), getattr(norm, "feature_axes", -1)}
    return axes <= {-1, (-1,)}


def _split_features(norm, got: int) -> bool:
    """Whether a norm gets other features than it normalizes: any other number where it has a scale or
    a bias of its own (flax would fail on them); without, 1/tp of them (a parameter-free norm's
    `num_features` may be a placeholder)."""
    if got == norm.num_features:
        return False
    owns = any(isinstance(getattr(norm, k, None), nnx.Param) for k in ("scale", "bias"))
    return owns or got * norm._jaxdist_tp.size == norm.num_features


@functools.cache
def _checked_norm_class(cls: type) -> type:
    """`cls` whose call first checks that its input holds the features it normalizes: a norm over a
    column layer's output gets one rank's features, and would normalize them alone (silently other
    numbers than one device's, or a shape error inside flax with a scale)."""

    def __call__(self, x, *args, **kwargs):
        if hasattr(x, "shape") and x.ndim and _split_features(self, x.shape[-1]):
            raise ValueError(
                f"TPPlan: {self._jaxdist_path} ({cls.__name__}) normalizes {self.num_features} features but gets "
                f"{x.shape[-1]} (tp={self._jaxdist_tp.size}): its input is one rank's features of a column layer; "
                "normalize where the features are whole (after the row layer, or gather the column's output: "
                "column(gather_output=True)), or per head (over head_dim) where heads are split"
            )
        return cls.__call__(self, x, *args, **kwargs)

    return type(f"TPChecked{cls.__name__}", (cls,), {"__call__": __call__})


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
        if layer is None and isinstance(sub, _NORMS) and _normalizes_last_axis(sub):
            object.__setattr__(sub, "_jaxdist_tp", binding)
            object.__setattr__(sub, "_jaxdist_path", "/".join(map(str, full)))
            sub.__class__ = _checked_norm_class(type(sub))
            continue
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
