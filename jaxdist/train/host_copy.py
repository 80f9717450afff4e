"""Copies of a train state's arrays in host memory, started without waiting for them.

`start_host_copy` enqueues a device-to-host copy of every array and returns at once. The copies are
new arrays: a step that donates (and overwrites) the originals right after is ordered behind the
copies' reads by the runtime (PJRT waits for a buffer's pending uses before handing it to a
donating computation), so the copies hold the values of the moment they were started.

Only one replica of each shard is copied when the whole array is in this process: a replicated
DDP state on 8 GPUs takes one copy of host memory, not 8 (a checkpoint writes one replica anyway).
`Checkpoints` uses it in single-process runs only; with several processes orbax transfers the
replica slices it writes itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

# pinned (page-locked) memory is what a GPU's DMA engine copies into without staging; a backend
# without it copies into ordinary host memory
HOST_KINDS = ("pinned_host", "unpinned_host")


def host_memory_kind(device) -> str | None:
    """The host memory kind `device` can copy into, pinned preferred; None if it has none."""
    kinds = {m.kind for m in device.addressable_memories()}
    return next((k for k in HOST_KINDS if k in kinds), None)


def start_host_copy(tree):
    """`tree` with every jax.Array replaced by a copy in host memory whose transfer has been enqueued
    (not waited for), a buffer of its own also where the array is in host memory already; other
    leaves are returned as they are. Arrays on a backend without host memory kinds are copied on
    their devices (costing device memory). The transfers are enqueued by one `device_put` of all
    the arrays: the loop waits for this call, and a train state has hundreds of arrays."""
    leaves, treedef = jax.tree.flatten(tree)
    # how an array is copied depends on its sharding only, and a state's hundreds of arrays share a few:
    # worked out once per sharding (per array it was a third of this call's time)
    plan_of: dict[jax.sharding.Sharding, Callable[[jax.Array], _Plan]] = {}
    plans = []
    for x in leaves:
        if isinstance(x, jax.Array):
            if x.sharding not in plan_of:
                plan_of[x.sharding] = _planner(x)
            plans.append(plan_of[x.sharding](x))
        else:
            plans.append(None)
    sources = [src for plan in plans if plan is not None for src in plan.sources]
    targets = [dst for plan in plans if plan is not None for dst in plan.targets]
    copies = iter(jax.device_put(sources, targets, may_alias=False) if sources else [])
    out = []
    for x, plan in zip(leaves, plans, strict=True):
        if plan is None:
            out.append(x)
        elif not plan.targets:
            out.append(x.copy())
        else:
            got = [next(copies) for _ in plan.targets]
            out.append(got[0] if plan.assemble is None else plan.assemble(got))
    return treedef.unflatten(out)


class _Plan:
    """How one array is copied: `sources[i]` onto `targets[i]`, then `assemble(copies)` (None: the one copy
    is the array; no targets: copied on its device)."""

    def __init__(self, sources, targets, assemble=None):
        self.sources, self.targets, self.assemble = sources, targets, assemble


def _planner(x: jax.Array) -> Callable[[jax.Array], _Plan]:
    """How the arrays of `x`'s sharding are copied: a function from such an array to its `_Plan`."""
    sharding = x.sharding
    device = next(iter(sharding.addressable_devices or sharding.device_set))  # one of this process's
    kind = host_memory_kind(device)
    if kind is None:

        def on_device(x):
            return _Plan([], [])  # on the device: a buffer the next step cannot donate

        return on_device
    if x.is_fully_addressable:
        if isinstance(sharding, jax.sharding.SingleDeviceSharding) or len(sharding.device_set) == 1:
            return _whole([jax.sharding.SingleDeviceSharding(device, memory_kind=kind)])
        if isinstance(sharding, jax.sharding.NamedSharding):
            return _one_replica(sharding, kind)
    # several processes (each copies the shards it holds) or another kind of sharding: every local shard
    return _whole([sharding.with_memory_kind(kind)])


def _whole(targets: list) -> Callable[[jax.Array], _Plan]:
    def whole(x):
        return _Plan([x], targets)

    return whole


def _one_replica(sharding: jax.sharding.NamedSharding, kind: str) -> Callable[[jax.Array], _Plan]:
    """Arrays of `sharding` in host memory on the devices of one replica: the mesh cut to its first
    position along each axis the array is not split over."""
    mesh, spec = sharding.mesh, sharding.spec
    used = {name for entry in spec if entry is not None for name in (entry if isinstance(entry, tuple) else (entry,))}
    cut = tuple(slice(None) if name in used else slice(0, 1) for name in mesh.axis_names)
    sub_mesh = jax.sharding.Mesh(mesh.devices[cut], mesh.axis_names, axis_types=mesh.axis_types)
    target = jax.sharding.NamedSharding(sub_mesh, spec, memory_kind=kind)
    devices = list(sub_mesh.devices.flat)
    targets = [jax.sharding.SingleDeviceSharding(d, memory_kind=kind) for d in devices]

    def one_replica(x):
        shards = {s.device: s.data for s in x.addressable_shards}
        return _Plan(
            [shards[d] for d in devices],
            targets,
            functools.partial(jax.make_array_from_single_device_arrays, x.shape, target),
        )

    return one_replica


def wait_for_host_copy(tree, threads: int = 8) -> None:
    """Wait for the copies `start_host_copy` started, reading each shard as a NumPy array on several
    threads: a jax.Array keeps that value, so orbax's own reads of the shards (one after another) find
    it ready instead of copying each again."""
    shards = [s.data for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) for s in x.addressable_shards]
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="jaxdist-host-copy") as pool:
        list(pool.map(np.asarray, shards))
