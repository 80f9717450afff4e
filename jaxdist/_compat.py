"""Small shims over JAX internals that moved between jax 0.10 and 0.12.

Only what jaxdist needs: which mesh axes are manual (inside `shard_map`), and
the StableHLO optimization barrier.
"""

from __future__ import annotations

import jax


def manual_axes() -> tuple[str, ...]:
    """Names of the mesh axes that are manual here (empty outside shard_map)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or getattr(mesh, "empty", False):
        return ()
    return tuple(getattr(mesh, "manual_axes", ()))


def hlo_optimization_barrier(operands) -> list:
    """Emit one StableHLO optimization_barrier over `operands` (MLIR values)."""
    from jax.extend.mlir.dialects import stablehlo

    return list(stablehlo.OptimizationBarrierOp(list(operands)).results)
