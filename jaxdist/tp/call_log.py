"""The placed layers' calls in one trace of a model: which layers each unit calls, in order, and the
einsum equation each is called with (what `TPPlan.resolve` reads when a layer's type does not say)."""

from __future__ import annotations

import contextlib
import functools

import jax
from flax import nnx

from jaxdist.tp.row_linearity import check_row_layer


def path_key(path) -> tuple:
    """A module path as the plan's keys spell it (list indices as strings)."""
    return tuple(map(str, path))


class CallLog:
    """Records, per unit, the placed layers a trace calls, in order, and the equation each is called with:
    those `plan` (a `TPPlan`) places."""

    def __init__(self, plan, sequence_parallel: bool = False):
        self.plan = plan
        self.sequence_parallel = sequence_parallel
        self._unit = "the model"
        self._calls: list[tuple[str, tuple, str | None]] = []
        self._checked: set[tuple] = set()
        self._arguments: dict[tuple, tuple] = {}

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
                object.__setattr__(sub, "_jaxdist_log", (self, path_key(full)))
                sub.__class__ = _recording_class(type(sub))
        return module

    def record(self, path: tuple, equation: str | None) -> None:
        self._calls.append((self._unit, path, equation))

    def remember_arguments(self, path: tuple, args, kwargs) -> None:
        """The shapes of a column layer's first call (`check_column_layer` calls it again on them)."""
        placement = self.plan.placement(path)
        if placement is None or placement.kind != "column" or path in self._arguments:
            return
        self._arguments[path] = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") and hasattr(a, "dtype") else a,
            (args, kwargs),
        )

    def arguments(self, path: tuple):
        """`(args, kwargs)` of the layer's first call as shapes, or None."""
        return self._arguments.get(path_key(path))

    def check_row(self, module, path: tuple, args, kwargs) -> None:
        """Refuse a row layer of the model's own type whose call is not linear in its weight (once a layer)."""
        placement = self.plan.placement(path)
        if placement is None or placement.kind != "row" or path in self._checked:
            return
        self._checked.add(path)
        check_row_layer(module, placement, "/".join(path), args, kwargs, self.sequence_parallel)

    def equation(self, module_path: tuple) -> str | None:
        """The equation the layer was first called with, if it was called with one."""
        key = path_key(module_path)
        return next((eq for _, p, eq in self._calls if p == key and eq), None)

    def units(self) -> dict[str, list[tuple]]:
        out: dict[str, list[tuple]] = {}
        for unit, path, _ in self._calls:
            out.setdefault(unit, []).append(path)
        return out


def call_equation(module, args, kwargs) -> str | None:
    """The einsum equation a layer is called with: an `einsum_str` argument or attribute, or any string
    argument with `->` (a layer called as `layer("BTD,DNH->BTNH", x)`)."""
    for value in (kwargs.get("einsum_str"), *args, *kwargs.values(), getattr(module, "einsum_str", None)):
        if isinstance(value, str) and "->" in value:
            return value
    return None


def _recording_call(self, *args, **kwargs):
    log, path = self._jaxdist_log
    log.record(path, call_equation(self, args, kwargs))
    log.check_row(self, path, args, kwargs)
    log.remember_arguments(path, args, kwargs)
    return type(self).__mro__[1].__call__(self, *args, **kwargs)


@functools.cache
def _recording_class(cls: type) -> type:
    return type(f"Recording{cls.__name__}", (cls,), {"__call__": _recording_call})
