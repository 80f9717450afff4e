"""Small shims over JAX internals that moved between jax 0.10 and 0.12.

Only what jaxdist needs: which mesh axes are manual (inside `shard_map`), which
manual axes a value varies over (shard_map's `check_vma` types), the StableHLO
optimization barrier, a strategy's own mesh as the context mesh (`on_mesh`), and
the model's own sharding annotations turned into no-ops where its code runs per
device (`model_sharding_dropped`).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator

import jax


def manual_axes() -> tuple[str, ...]:
    """Names of the mesh axes that are manual here (empty outside shard_map)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or getattr(mesh, "empty", False):
        return ()
    return tuple(getattr(mesh, "manual_axes", ()))


def varying_axes(x) -> frozenset:
    """The manual mesh axes `x` (an array, a tracer or an abstract value) varies over under
    `shard_map(check_vma=True)` (empty otherwise).

    jax 0.10 keeps them in the type's `mat.varying`; earlier versions called them `vma`.
    """
    aval = getattr(x, "aval", None)
    if aval is None:
        aval = x if hasattr(x, "mat") or hasattr(x, "vma") else jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def hlo_optimization_barrier(operands) -> list:
    """Emit one StableHLO optimization_barrier over `operands` (MLIR values)."""
    from jax.extend.mlir.dialects import stablehlo

    return list(stablehlo.OptimizationBarrierOp(list(operands)).results)


def on_mesh(mesh: jax.sharding.Mesh):
    """A context in which `mesh` is JAX's context mesh (`jax.set_mesh`), whatever mesh the caller set.

    A strategy computes on its own copy of the mesh (Auto axes); inside a user's `jax.set_mesh` of
    another mesh, or of the same devices with Explicit axes, JAX refuses shardings of a mesh other than
    the context's. Inside a trace (where `jax.set_mesh` is refused) the context is left as it is.
    """
    from jax._src import core

    if not getattr(core, "trace_state_clean", lambda: True)():
        return contextlib.nullcontext()
    return jax.set_mesh(mesh)


# -- the model's own sharding inside the per-device program ------------------------------------
#
# A strategy runs the model's code per device (inside `shard_map`, every mesh axis manual, or
# traced at prepare on one device's shapes). The sharding a published model states in its own
# code, `jax.lax.with_sharding_constraint(x, P("data", ...))`, `out_sharding=` of einsum / dot /
# nnx.Linear, `jax.sharding.reshard`, flax's logical constraints and its eager sharding of
# `nnx.with_partitioning` variables, then names manual axes (or another mesh's): JAX refuses each.
# Per device there is nothing left to place: the strategy has placed every value already. So
# while the model's code runs there, these APIs return their input unchanged (and `out_sharding`
# reads as None): the annotations are dropped, the values are those of the model without them.

_SHARDING_APIS = ("with_sharding_constraint", "reshard", "auto_axes", "explicit_axes", "canonicalize_sharding")


class _Dropping(threading.local):
    depth = 0  # this thread is running the model's code per device (nested entries count)


_dropping = _Dropping()
_install_lock = threading.Lock()
_installed: list[tuple[object, str, object]] = []  # (module, name, original) replaced while any thread drops
_users = 0  # threads inside `model_sharding_dropped`


def _originals() -> dict[str, object]:
    """The JAX functions that apply a sharding annotation, by name (those this jax version has)."""
    from jax._src import sharding_impls

    found = {
        "with_sharding_constraint": getattr(jax.lax, "with_sharding_constraint", None),
        "reshard": getattr(jax.sharding, "reshard", None),
        "auto_axes": getattr(jax.sharding, "auto_axes", None),
        "explicit_axes": getattr(jax.sharding, "explicit_axes", None),
        "canonicalize_sharding": getattr(sharding_impls, "canonicalize_sharding", None),
    }
    return {name: fn for name, fn in found.items() if fn is not None}


def _unchanged(x, *args, **kwargs):
    return x


def _out_sharding_none(*args, **kwargs):
    return None


def _without_sharding_kwargs(fun: Callable) -> Callable:
    """`fun` called as it is: `auto_axes` / `explicit_axes` applied per device (their sharding
    keyword, when passed at the call, is dropped)."""

    @functools.wraps(fun)
    def call(*args, **kwargs):
        kwargs.pop("out_sharding", None)
        kwargs.pop("in_sharding", None)
        return fun(*args, **kwargs)

    return call


def _as_is_decorator(f=None, /, **_):
    return _without_sharding_kwargs if f is None else _without_sharding_kwargs(f)


_DROPPED = {
    "with_sharding_constraint": _unchanged,
    "reshard": _unchanged,
    "auto_axes": _as_is_decorator,
    "explicit_axes": _as_is_decorator,
    "canonicalize_sharding": _out_sharding_none,
}


def _switch(name: str, original) -> Callable:
    """`original`, or its dropped version in a thread that runs the model's code per device."""

    @functools.wraps(original)
    def switched(*args, **kwargs):
        if _dropping.depth:
            return _DROPPED[name](*args, **kwargs)
        return original(*args, **kwargs)

    switched._jaxdist_original = original
    return switched


_found: dict = {"modules": -1, "places": []}  # the last scan: how many modules were loaded, what it found


def _places(originals: dict[str, object]) -> list[tuple[object, str, object]]:
    """`(module, name, original)` for every loaded module holding a sharding API under its name;
    rescanned only when modules were loaded since the last scan (each strategy trace enters often)."""
    if _found["modules"] != len(sys.modules):
        places = []
        for module in list(sys.modules.values()):
            names = getattr(module, "__dict__", None)
            if isinstance(names, dict):
                places += [(module, name, fn) for name, fn in originals.items() if names.get(name) is fn]
        _found.update(modules=len(sys.modules), places=places)
    return [(m, name, fn) for m, name, fn in _found["places"] if vars(m).get(name) is fn]


def _install() -> None:
    """Point every loaded module's reference to a sharding API (jax's own, flax's, the user's
    `from jax.lax import with_sharding_constraint`) at its switched version."""
    originals = _originals()
    switched = {name: _switch(name, fn) for name, fn in originals.items()}
    for module, name, fn in _places(originals):
        _installed.append((module, name, fn))
        setattr(module, name, switched[name])


def _uninstall() -> None:
    while _installed:
        module, name, fn = _installed.pop()
        setattr(module, name, fn)


@contextlib.contextmanager
def model_sharding_dropped() -> Iterator[None]:
    """While the model's code runs per device (this thread, nested entries included), its own
    sharding annotations are no-ops (see above). Usable as a decorator."""
    global _users
    if _dropping.depth:
        _dropping.depth += 1
        try:
            yield
        finally:
            _dropping.depth -= 1
        return
    with _install_lock:
        if not _users:
            _install()
        _users += 1
    _dropping.depth = 1
    try:
        yield
    finally:
        _dropping.depth = 0
        with _install_lock:
            _users -= 1
            if not _users:
                _uninstall()


# -- one JAX function routed through another in this thread ---------------------------------------


class _Routes(threading.local):
    active: dict | None = None  # original -> the function calls to it take in this thread


_routes = _Routes()
_route_lock = threading.Lock()
_routed: dict = {}  # original -> [users, [(module, name), ...] pointing at its switch]


def _route_switch(original: Callable) -> Callable:
    @functools.wraps(original)
    def switched(*args, **kwargs):
        active = _routes.active
        target = active.get(original) if active else None
        return (target or original)(*args, **kwargs)

    switched._jaxdist_original = original
    return switched


@contextlib.contextmanager
def routed(original: Callable, replacement: Callable) -> Iterator[None]:
    """While inside (this thread), every call to `original` made through a module's reference to it
    (`jax.nn.dot_product_attention`, or a user's `from jax.nn import dot_product_attention`) runs
    `replacement` instead; other threads keep calling `original`. `replacement` calls `original`
    itself to reach the function. Not nestable for the same `original`."""
    with _route_lock:
        entry = _routed.get(original)
        if entry is None:
            switched = _route_switch(original)
            places = []
            for module in list(sys.modules.values()):
                names = getattr(module, "__dict__", None)
                if isinstance(names, dict):
                    places += [(module, name) for name, fn in list(names.items()) if fn is original]
            for module, name in places:
                setattr(module, name, switched)
            entry = _routed[original] = [0, places]
        entry[0] += 1
    before = _routes.active
    _routes.active = {**(before or {}), original: replacement}
    try:
        yield
    finally:
        _routes.active = before
        with _route_lock:
            entry[0] -= 1
            if not entry[0]:
                for module, name in entry[1]:
                    setattr(module, name, original)
                del _routed[original]
