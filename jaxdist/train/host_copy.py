"""Copies of a train state's arrays in host memory, started without waiting for them.

`start_host_copy` enqueues a device-to-host copy of every array and returns at once. The copies are
new arrays: a step that donates (and overwrites) the originals right after is ordered behind the
copies' reads by the runtime (PJRT waits for a buffer's pending uses before handing it to a
donating computation), so the copies hold the values of the moment they were started.

Only one replica of each shard is copied when the whole array is in this process: a replicated
DDP state on 8 GPUs takes one copy of host memory, not 8 (a checkpoint writes one replica anyway).
`Checkpoints` uses it for every save but the compressed ones of several processes, where orbax
transfers the replica slices it writes itself.

`pack=True` copies the arrays that lie whole on one device as a few buffers per device: a program
packs their bytes side by side on the device, in runs of about `PACK_CHUNK_BYTES` (in the tree's
order), one transfer moves each run, and each array comes back as a `HostSlice` (a NumPy view into
its run's buffer, ready when that transfer is: a checkpoint's writer starts on the first runs while
the later ones are still on their way). On an H200 a copy of a 1.39 GiB state every 10 steps cost
a compute-bound loop 2.9% of its time as 447 transfers and 1.4% packed (`bench/host_copy_cost.py`,
`bench/RESULTS.md`); a device copy of the state alone, as the packing is, cost 0.7%. The packed
buffers cost device memory the size of those arrays until their transfers are done; where the
device has no room for them, that device's arrays are copied one by one instead. On a CPU backend
packing is one more copy in host memory: `Checkpoints` packs only off the CPU.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.compat import on_mesh
from jaxdist.core.runs import consecutive_runs

# pinned (page-locked) memory is what a GPU's DMA engine copies into without staging; a backend
# without it copies into ordinary host memory
HOST_KINDS = ("pinned_host", "unpinned_host")
# each array's bytes start at a multiple of this in a packed buffer: its NumPy view is aligned for any dtype
PACK_ALIGN = 64
# a device's packed arrays are cut into buffers of about this many bytes (an array is never split), each its
# own transfer: a checkpoint's writer waits for the first buffer, not for all. On an H200, a 1.39 GiB state
# copied every 10 steps cost a compute-bound loop 1.4% in runs of 16 MiB, 1.7% of 64 MiB, 1.5% of 256 MiB,
# 2.0% as one buffer (bench/host_copy_cost.py)
PACK_CHUNK_BYTES = 16 << 20
# the dtypes a packed buffer holds (their bytes taken by a bitcast on the device); others copy one by one
_PACKABLE = {np.dtype(t) for t in ("float32", "float16", "bfloat16", "int32", "uint32", "int16", "uint16")}
_PACKABLE |= {np.dtype(t) for t in ("int8", "uint8", "bool", "float64", "int64", "uint64")}
_PACKABLE |= {np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)}


def _packable(dtype) -> bool:
    # (a PRNG key array's dtype is no NumPy dtype)
    return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended) and np.dtype(dtype) in _PACKABLE


def host_memory_kind(device) -> str | None:
    """The host memory kind `device` can copy into, pinned preferred; None if it has none."""
    kinds = {m.kind for m in device.addressable_memories()}
    return next((k for k in HOST_KINDS if k in kinds), None)


def start_host_copy(tree, pack: bool = False):
    """`tree` with every jax.Array replaced by a copy in host memory whose transfer has been enqueued
    (not waited for), a buffer of its own also where the array is in host memory already; other
    leaves are returned as they are. Arrays on a backend without host memory kinds are copied on
    their devices (costing device memory). The transfers of the arrays not packed are enqueued by
    one `device_put`: the loop waits for this call, and a train state has hundreds of arrays. `pack`: the
    arrays that lie whole on one device come back as `HostSlice`s of a few transfers per device (see the
    module's docstring); the rest as above."""
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
    packed = _start_packed(leaves, plans) if pack else {}
    sources = [src for i, plan in enumerate(plans) if plan is not None and i not in packed for src in plan.sources]
    targets = [dst for i, plan in enumerate(plans) if plan is not None and i not in packed for dst in plan.targets]
    copies = iter(jax.device_put(sources, targets, may_alias=False) if sources else [])
    out = []
    for i, (x, plan) in enumerate(zip(leaves, plans, strict=True)):
        if i in packed:
            out.append(packed[i])
        elif plan is None:
            out.append(x)
        elif not plan.targets:
            out.append(x.copy())
        else:
            got = [next(copies) for _ in plan.targets]
            out.append(got[0] if plan.assemble is None else plan.assemble(got))
    return treedef.unflatten(out)


class _Packed:
    """A run of one device's arrays copied into host memory as one buffer (`start_host_copy(pack=True)`)."""

    def __init__(self, buffer: jax.Array):
        self.buffer, self._lock, self._host = buffer, threading.Lock(), None

    def wait(self) -> None:
        """Wait for the transfer (`block_until_ready`, which releases the interpreter lock)."""
        self.buffer.block_until_ready()

    def host(self) -> np.ndarray:
        """The buffer as bytes in host memory, once its transfer is done (a view, not a copy, of pinned memory)."""
        with self._lock:
            if self._host is None:
                self.wait()
                self._host = np.asarray(self.buffer).view(np.uint8)
            return self._host


class HostSlice:
    """One array's value inside a packed host copy: its shape and dtype, and the array itself as a NumPy
    view into the packed buffer (`np.asarray`), available once the transfer is done."""

    __slots__ = ("packed", "offset", "shape", "dtype")

    def __init__(self, packed: _Packed, offset: int, shape: tuple[int, ...], dtype: np.dtype):
        self.packed, self.offset, self.shape, self.dtype = packed, offset, shape, dtype

    @property
    def nbytes(self) -> int:
        return _nbytes(self.shape, self.dtype)

    def __array__(self, dtype=None, copy=None):
        """A read-only view of the packed buffer; `copy=True` (`np.array`): a writable array of its own."""
        data = self.packed.host()[self.offset : self.offset + self.nbytes]
        value = data.view(self.dtype).reshape(self.shape)
        if dtype is not None and np.dtype(dtype) != self.dtype:
            if copy is False:
                raise ValueError(f"a HostSlice of {self.dtype} becomes {np.dtype(dtype)} only by a copy")
            return value.astype(dtype)
        return value.copy() if copy else value


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def _padded(nbytes: int) -> int:
    return nbytes + (-nbytes % PACK_ALIGN)


@jax.jit
def _pack(runs: list[list[jax.Array]]) -> list[jax.Array]:
    """Per run of `runs`, the bytes of its arrays side by side, each padded to `PACK_ALIGN`: one buffer of
    32-bit words on their device per run (moved as words, not bytes: a copy kernel of one-byte
    elements is several times slower)."""
    out = []
    for arrays in runs:
        pieces = []
        for a in arrays:
            words = _words(a)
            pad = _padded(4 * words.size) // 4 - words.size
            pieces.append(jnp.pad(words, (0, pad)) if pad else words)
        out.append(jnp.concatenate(pieces))
    return out


def _words(a: jax.Array) -> jax.Array:
    """`a`'s bytes as uint32 words, in memory order (the last word's spare bytes zero)."""
    if a.dtype.itemsize >= 4 and a.dtype != jnp.bool_:
        return jax.lax.bitcast_convert_type(a, jnp.uint32).reshape(-1)
    raw = a.astype(jnp.uint8) if a.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(a, jnp.uint8)
    raw = raw.reshape(-1)
    if raw.size % 4:
        raw = jnp.pad(raw, (0, -raw.size % 4))
    return jax.lax.bitcast_convert_type(raw.reshape(-1, 4), jnp.uint32)


def _start_packed(leaves: list, plans: list) -> dict[int, HostSlice]:
    """Pack the arrays of `leaves` that lie whole on one device (two or more per device) and enqueue the
    transfers of each device's packed buffers, in the leaves' order; their `HostSlice`s by leaf index."""
    groups: dict = {}
    for i, plan in enumerate(plans):
        if plan is not None and plan.whole_on is not None and _packable(leaves[i].dtype):
            groups.setdefault(plan.whole_on, []).append(i)
    out = {}
    for (device, kind), indices in groups.items():
        if len(indices) < 2:
            continue
        # each array as its one device's buffer (no mesh of its own), packed with that device's mesh as the
        # context mesh: a caller's `jax.set_mesh` of more devices, or with Explicit axes, would refuse them
        source = {i: plans[i].sources[0].addressable_shards[0].data for i in indices}
        sizes = [_padded(_nbytes(source[i].shape, source[i].dtype)) for i in indices]
        runs = consecutive_runs(indices, sizes, PACK_CHUNK_BYTES)
        try:
            with on_mesh(jax.sharding.Mesh(np.array([device]), ("pack",))):
                buffers = _pack([[source[i] for i in run] for run in runs])
        except Exception as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            continue  # no device memory for the packed buffers: these arrays are copied one by one
        target = jax.sharding.SingleDeviceSharding(device, memory_kind=kind)
        copies = jax.device_put(buffers, [target] * len(buffers), may_alias=False)
        for run, copy in zip(runs, copies, strict=True):
            packed, offset = _Packed(copy), 0
            for i in run:
                out[i] = HostSlice(packed, offset, tuple(source[i].shape), np.dtype(source[i].dtype))
                offset += _padded(out[i].nbytes)
    return out


class _Plan:
    """How one array is copied: `sources[i]` onto `targets[i]`, then `assemble(copies)` (None: the one copy
    is the array; no targets: copied on its device). `whole_on`: (device, host memory kind) where the
    one source holds the whole array in device memory (it may then be packed), else None."""

    def __init__(self, sources, targets, assemble=None, whole_on=None):
        self.sources, self.targets, self.assemble, self.whole_on = sources, targets, assemble, whole_on


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
            in_device_memory = sharding.memory_kind in (None, "device")
            return _whole([jax.sharding.SingleDeviceSharding(device, memory_kind=kind)], in_device_memory)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return _one_replica(sharding, kind)
    # several processes (each copies the shards it holds) or another kind of sharding: every local shard
    return _whole([sharding.with_memory_kind(kind)])


def _whole(targets: list, packable: bool = False) -> Callable[[jax.Array], _Plan]:
    whole_on = (next(iter(targets[0].device_set)), targets[0].memory_kind) if packable else None

    def whole(x):
        return _Plan([x], targets, whole_on=whole_on)

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
    # replicated over every device: one device's shard is the whole array
    whole_on = (devices[0], kind) if len(devices) == 1 and sharding.memory_kind in (None, "device") else None

    def one_replica(x):
        shards = {s.device: s.data for s in x.addressable_shards}
        return _Plan(
            [shards[d] for d in devices],
            targets,
            functools.partial(jax.make_array_from_single_device_arrays, x.shape, target),
            whole_on,
        )

    return one_replica


def wait_for_host_copy(tree) -> None:
    """Wait for the copies `start_host_copy` started, then read each shard (and packed buffer) as a NumPy
    array: a jax.Array keeps that value, so orbax's own reads of the shards (one after another) find it
    ready instead of copying each again. The wait comes first (`block_until_ready`, which releases the
    interpreter lock): with NumPy reads of the copies still in flight on 8 threads, a compute-bound loop
    on an H200 lost 0.7% more of its time (bench/RESULTS.md)."""
    leaves = jax.tree.leaves(tree)
    arrays = [x for x in leaves if isinstance(x, jax.Array)]
    packs = list({id(x.packed): x.packed for x in leaves if isinstance(x, HostSlice)}.values())
    jax.block_until_ready(arrays)
    for packed in packs:
        packed.host()
    for x in arrays:
        for shard in x.addressable_shards:
            np.asarray(shard.data)
