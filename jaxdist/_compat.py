"""Small shims over JAX internals that moved between jax 0.10 and 0.12.

Only what jaxdist needs: which mesh axes are manual (inside `shard_map`), which
manual axes a value varies over (shard_map's `check_vma` types), the StableHLO
optimization barrier, and a strategy's own mesh as the context mesh (`on_mesh`).
"""

from __future__ import annotations

import contextlib

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
