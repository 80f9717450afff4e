"""Meshes over the 8 simulated CPU devices, shared by the tests."""

import jax
import numpy as np
from jax.sharding import AxisType, Mesh


def cpu_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    devices = np.asarray(jax.devices("cpu")[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, names, axis_types=(AxisType.Explicit,) * len(names))


# (mesh shape, mesh axis names, the axis the collective runs over)
MESH_AXES = [
    ((8,), ("x",), "x"),
    ((2, 4), ("a", "b"), "a"),
    ((2, 4), ("a", "b"), "b"),
    ((4, 2), ("a", "b"), "a"),
    ((4, 2), ("a", "b"), "b"),
    ((2, 4), ("a", "b"), ("a", "b")),
]


def mesh_axes_id(case) -> str:
    shape, _, axis = case
    axis = "+".join(axis) if isinstance(axis, tuple) else axis
    return f"{'x'.join(map(str, shape))}-{axis}"
