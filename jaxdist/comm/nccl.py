"""The `nccl` backend: jaxdist.comm ops as XLA FFI calls into NCCL (GPU only).

Communicators are jaxdist's own, one per mesh axis and local device, created by
`init(mesh)`. Unique ids reach other processes through `jax.distributed`'s
key-value store. Non-blocking communicators (`blocking=False`) return from
`init` at once and let model setup overlap NCCL's setup; their first use waits.

Environment::

  JAXDIST_NCCL_LIBRARY         libnccl.so.2 to load (default: the nvidia.nccl wheel's,
                               the one JAX's CUDA plugin uses)
  JAXDIST_NCCL_TIMEOUT_S       deadline for any NCCL call to leave ncclInProgress, and for every
                               enqueued op to finish on the GPU (the watchdog; 300)
  JAXDIST_NCCL_DEBUG_DELAY_US  sleep this long on the stream before every NCCL op (race tests)
  (the flight recorder's and the watchdog's: see jaxdist.comm.watchdog)
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import importlib.util
import itertools
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxdist.comm import native as _native
from jaxdist.comm import watchdog
from jaxdist.comm._backend import Backend, current_site, floating_and_int_dtypes
from jaxdist.comm._checks import as_axis_names
from jaxdist.comm._ffi_call import ffi_call
from jaxdist.comm._sequence import sequence
from jaxdist.comm.watchdog import NcclTimeoutError, check, flight_record, set_recorder  # noqa: F401  (public API)
from jaxdist.compat import varying_axes

NCCL_LIBRARY_ENV = "JAXDIST_NCCL_LIBRARY"
TIMEOUT_ENV = "JAXDIST_NCCL_TIMEOUT_S"
DELAY_ENV = "JAXDIST_NCCL_DEBUG_DELAY_US"

_KIND = {"all_reduce": 0, "all_gather": 1, "reduce_scatter": 2, "sendrecv": 3}
_REDOP = {"sum": 0, "mean": 1, "max": 2, "min": 3}
MAX_GROUP_CALLS = 2048  # NCCL's documented limit on the calls between a ncclGroupStart and its ncclGroupEnd
_TARGETS = (
    "jaxdist_nccl_collective",
    "jaxdist_nccl_start",
    "jaxdist_nccl_wait",
    "jaxdist_nccl_start_group",
    "jaxdist_nccl_wait_group",
    "jaxdist_memcpy",
    "jaxdist_bench_ungrouped",
)
# ffi/src/comms.h PollMode: how a wait for a non-blocking communicator spends its first 500 us
_POLL_MODES = {"yield": 0, "spin": 1, "local": 2}
POLL_ENV = "JAXDIST_NCCL_POLL"


def nccl_library_path() -> Path:
    """The libnccl.so.2 to use: $JAXDIST_NCCL_LIBRARY, else the nvidia.nccl wheel's."""
    if os.environ.get(NCCL_LIBRARY_ENV):
        return Path(os.environ[NCCL_LIBRARY_ENV])
    spec = importlib.util.find_spec("nvidia.nccl") if importlib.util.find_spec("nvidia") else None
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(root) / "lib" / "libnccl.so.2"
        if candidate.is_file():
            return candidate
    raise _native.NativeLibraryError(
        "no libnccl.so.2 found: install jaxdist[cuda12] or jaxdist[cuda13] (the nvidia-nccl wheel JAX uses), "
        f"or set ${NCCL_LIBRARY_ENV} to its path"
    )


@functools.cache
def load() -> ctypes.CDLL:
    """Load NCCL into jaxdist's FFI library and register the FFI targets (once)."""
    lib = _native.ffi_library()
    path = nccl_library_path()
    try:
        _native.call("jaxdist_nccl_load", str(path).encode())
    except RuntimeError as e:
        raise _native.NativeLibraryError(str(e)) from None
    lib.jaxdist_set_timeout_ms(int(float(os.environ.get(TIMEOUT_ENV, "300")) * 1000))
    lib.jaxdist_set_debug_delay_us(int(os.environ.get(DELAY_ENV, "0")))
    lib.jaxdist_set_poll_mode(_poll_mode(os.environ.get(POLL_ENV, "local")))
    for name in _TARGETS:
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="CUDA")
    watchdog.start(_timeout_s())
    return lib


def set_timeout(seconds: float) -> None:
    """Deadline for every NCCL call to finish its enqueue, and for every enqueued op to
    finish on the GPU before the watchdog aborts (default 300 s, or $JAXDIST_NCCL_TIMEOUT_S)."""
    load().jaxdist_set_timeout_ms(int(seconds * 1000))


def _poll_mode(name: str) -> int:
    if name not in _POLL_MODES:
        raise ValueError(f"unknown NCCL poll mode {name!r} (from ${POLL_ENV}?); choose one of {sorted(_POLL_MODES)}")
    return _POLL_MODES[name]


def set_poll_mode(mode: str) -> None:
    """How a wait for a non-blocking communicator spends its first 500 us (then it sleeps with back-off).

    "local" (default): NCCL's group thread (one per op) starts on the issuing CPU; the wait busy-polls
    8 polls, then yields that CPU to it. "yield": yields between polls. "spin": busy-polls."""
    load().jaxdist_set_poll_mode(_poll_mode(mode))


def set_debug_delay(microseconds: int) -> None:
    """Sleep this long on the stream before every NCCL op: for race tests only."""
    load().jaxdist_set_debug_delay_us(int(microseconds))


# -- communicators -------------------------------------------------------------

_keys = itertools.count(1)
_registry: dict[tuple, int] = {}  # (axis names, axis sizes, group axes) -> communicator key


def _mesh_key(axis_names, axis_sizes, group: tuple[str, ...]) -> tuple:
    return (tuple(axis_names), tuple(int(s) for s in axis_sizes), group)


def _groups(mesh: Mesh, group: tuple[str, ...]) -> np.ndarray:
    """Devices as rows of one communicator each; a device's column is its rank.

    Ranks follow jaxdist's rule (see `_ranks`): the group's axes in tuple
    order, the first most significant, whatever the mesh's axis order.
    """
    names = list(mesh.axis_names)
    order = [names.index(a) for a in names if a not in group] + [names.index(a) for a in group]
    size = int(np.prod([mesh.shape[a] for a in group]))
    return np.transpose(mesh.devices, order).reshape(-1, size)


def _unique_ids(rows: np.ndarray, tag: str) -> list[bytes]:
    """One NCCL unique id per group, made by the process holding its rank 0 and
    shared through jax.distributed's key-value store."""
    lib = load()
    nbytes = lib.jaxdist_unique_id_bytes()
    client = None
    if jax.process_count() > 1:
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None:
            raise RuntimeError("multi-process nccl init needs jax.distributed.initialize() first")
    ids = []
    for i, row in enumerate(rows):
        key = f"jaxdist/nccl/{tag}/{i}"
        if row[0].process_index == jax.process_index():
            buf = ctypes.create_string_buffer(nbytes)
            _native.call("jaxdist_nccl_unique_id", buf)
            ids.append(buf.raw)
            if client is not None:
                client.key_value_set(key, buf.raw.hex())
        elif any(d.process_index == jax.process_index() for d in row):
            ids.append(bytes.fromhex(client.blocking_key_value_get(key, int(_timeout_s() * 1000))))
        else:
            ids.append(b"")
    return ids


def _timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV, "300"))


def init(mesh: Mesh, axes=None, *, blocking: bool = True) -> None:
    """Create jaxdist's NCCL communicators for `mesh`.

    One communicator per group of each axis in `axes` (default: every mesh
    axis); an entry may be a tuple of axes, for collectives over several at
    once. With `blocking=False` this returns while NCCL still initializes;
    the first op waits for it (or call `wait_ready`).
    """
    if not any(d.platform in ("gpu", "cuda") for d in mesh.devices.flat):
        found = "/".join(sorted({d.platform for d in mesh.devices.flat}))
        raise RuntimeError(
            f"the nccl backend needs a mesh of CUDA GPUs, this one has {found} devices; use backend='xla' on them"
        )
    load()
    groups = [(a,) if isinstance(a, str) else tuple(a) for a in (axes or mesh.axis_names)]
    for group in groups:
        k = _mesh_key(mesh.axis_names, mesh.devices.shape, group)
        if k in _registry:
            continue
        key = next(_keys)
        rows = _groups(mesh, group)
        ids = _unique_ids(rows, f"{key}")
        local = [
            (ids[r], rows.shape[1], c, d.local_hardware_id)
            for r, row in enumerate(rows)
            for c, d in enumerate(row)
            if d.process_index == jax.process_index()
        ]
        n = len(local)

        def ints(xs):
            return (ctypes.c_int * len(xs))(*xs)

        _native.call(
            "jaxdist_comm_init",
            key,
            n,
            b"".join(x[0] for x in local),
            ints([x[1] for x in local]),
            ints([x[2] for x in local]),
            ints([x[3] for x in local]),
            int(blocking),
            "+".join(group).encode(),
        )
        _registry[k] = key


def wait_ready() -> None:
    """Block until every communicator finished initializing."""
    for key in _registry.values():
        _native.call("jaxdist_comm_wait_ready", key)


def shutdown() -> None:
    """End of the run: check that every process got to the end with the same ops (multi-process;
    raises NcclTimeoutError naming the op and the missing rank otherwise), stop the watchdog,
    then finalize and destroy every communicator (aborted ones are only freed).

    Also run at interpreter exit, before jax's own exit handler shuts jax.distributed down
    (atexit runs handlers last-registered first, and this module registers after jax's)."""
    try:
        if _registry:
            watchdog.agree_before_shutdown(_timeout_s() + 10)
    finally:
        watchdog.stop()
        while _registry:
            _, key = _registry.popitem()
            try:
                _native.call("jaxdist_comm_destroy", key)
            except RuntimeError as e:  # at exit there is no one left to raise to
                print(f"jaxdist: {e}")


def _shutdown_at_exit() -> None:
    if not _native.loaded():  # no communicator and no watchdog ever existed in this process
        return
    try:
        shutdown()
    except NcclTimeoutError as e:
        print(f"jaxdist: {e}", file=sys.stderr, flush=True)
    if watchdog.failure():
        # A failed run must not end with status 0 (an exception in an exit handler leaves it
        # alone), nor wait in jax.distributed's shutdown barrier for a peer that may never come.
        watchdog.exit_after_failure()


atexit.register(_shutdown_at_exit)


def _comm_key(axis_name) -> int:
    mesh = jax.sharding.get_abstract_mesh()
    group = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    k = _mesh_key(mesh.axis_names, mesh.axis_sizes, group)
    if k not in _registry:
        # a tuple of axes needs its own communicator, in its own order (ranks follow the tuple order)
        call = "init(mesh)" if len(group) == 1 else f"init(mesh, axes=[{group!r}])"
        raise RuntimeError(
            f"no NCCL communicator for axis {axis_name!r} of a mesh {dict(zip(k[0], k[1], strict=True))}; "
            f"call jaxdist.comm.nccl.{call} before tracing code that uses backend='nccl'"
        )
    return _registry[k]


# -- the backend ---------------------------------------------------------------

_op_ids = itertools.count(1)
_site_ids: dict[str, int] = {}
_NO_PERM = np.zeros((0,), np.int64)


class NcclBackend(Backend):
    name = "nccl"
    dtypes = floating_and_int_dtypes()
    # XLA sees a start's output as ready at once and may copy it (e.g. as a loop carry) while
    # NCCL still writes it on the side stream: handles must be waited in the trace they began in.
    handles_cross_loops = False

    def _call(self, target, outs, *args, aliases=None, **attrs):
        return ffi_call(target, outs, *args, aliases=aliases, **attrs)

    def _attrs(self, kind, axis_name, op="sum", perm=()):
        src = np.asarray([s for s, _ in perm], np.int64) if perm else _NO_PERM
        dst = np.asarray([d for _, d in perm], np.int64) if perm else _NO_PERM
        return dict(comm_key=_comm_key(axis_name), kind=_KIND[kind], redop=_REDOP[op], perm_src=src, perm_dst=dst)

    @staticmethod
    def _layout(kind, x, params):
        """NCCL works on the leading dimension: move the op's dimension there, and say the result shape."""
        size = params["size"]
        if kind == "all_gather":
            if params["tiled"]:
                xt = jnp.moveaxis(x, params["axis"], 0)
                return xt, (size * xt.shape[0], *xt.shape[1:])
            return x, (size, *x.shape)
        if kind == "reduce_scatter":
            xt = jnp.moveaxis(x, params["scatter_axis"], 0)
            return xt, (xt.shape[0] // size, *xt.shape[1:])
        return x, x.shape

    @staticmethod
    def _unlayout(kind, y, params):
        if kind == "all_gather":
            return jnp.moveaxis(y, 0, params["axis"])
        if kind == "reduce_scatter":
            return jnp.moveaxis(y, 0, params["scatter_axis"])
        return y

    def _op_attrs(self, kind, axis_name, params):
        return self._attrs(kind, axis_name, params.get("op", "sum"), params.get("perm", ()))

    def _sync(self, kind, x, axis_name, params):
        xt, shape = self._layout(kind, x, params)
        out = jax.ShapeDtypeStruct(shape, x.dtype)
        y = self._call("jaxdist_nccl_collective", out, xt, **self._op_attrs(kind, axis_name, params))
        return _typed(self._unlayout(kind, y, params), _result_axes(kind, x, axis_name))

    def all_gather(self, x, axis_name, **params):
        return self._sync("all_gather", x, axis_name, params)

    def reduce_scatter(self, x, axis_name, **params):
        return self._sync("reduce_scatter", x, axis_name, params)

    def all_reduce(self, x, axis_name, **params):
        return self._sync("all_reduce", x, axis_name, params)

    def sendrecv(self, x, axis_name, **params):
        return self._sync("sendrecv", x, axis_name, params)

    def start(self, kind, x, axis_name, params):
        xt, shape = self._layout(kind, x, params)
        site = current_site()
        params["op_id"] = _site_ids.setdefault(site, next(_op_ids)) if site else next(_op_ids)
        params["result_axes"] = _result_axes(kind, x, axis_name)
        outs = (jax.ShapeDtypeStruct(xt.shape, xt.dtype), jax.ShapeDtypeStruct(shape, x.dtype))
        # Result 0 aliases the input: XLA keeps the input alive until wait.
        return tuple(
            self._call(
                "jaxdist_nccl_start",
                outs,
                xt,
                aliases={0: 0},
                op_id=params["op_id"],
                **self._op_attrs(kind, axis_name, params),
            )
        )

    def start_group(self, kind, xs, axis_name, params):
        # One FFI call, one NCCL group over every array in place: results 0..n-1 alias the inputs
        # (kept alive until the wait), results n..2n-1 are the collectives' outputs.
        if len(xs) > MAX_GROUP_CALLS:
            raise ValueError(
                f"{kind}: a group of {len(xs)} arrays is more than the {MAX_GROUP_CALLS} calls NCCL documents for "
                "one ncclGroupStart/ncclGroupEnd; split it into groups of at most that many, or pack the arrays "
                "into buffers (DDP's pack_buckets=True, the engine's pack_units=True)"
            )
        site = current_site()
        op_id = _site_ids.setdefault(site, next(_op_ids)) if site else next(_op_ids)
        laid = []
        for x, p in zip(xs, params, strict=True):
            xt, shape = self._layout(kind, x, p)
            p["op_id"] = op_id
            p["result_axes"] = _result_axes(kind, x, axis_name)
            laid.append((xt, jax.ShapeDtypeStruct(shape, x.dtype)))
        n = len(laid)
        outs = tuple(jax.ShapeDtypeStruct(xt.shape, xt.dtype) for xt, _ in laid) + tuple(out for _, out in laid)
        attrs = self._attrs(kind, axis_name, params[0].get("op", "sum"))
        return tuple(
            self._call(
                "jaxdist_nccl_start_group",
                outs,
                *(xt for xt, _ in laid),
                aliases={i: i for i in range(n)},
                op_id=op_id,
                comm_key=attrs["comm_key"],
                kind=attrs["kind"],
                redop=attrs["redop"],
            )
        )

    def finish_group(self, kind, buffers, axis_name, params):
        n = len(params)
        outs = tuple(jax.ShapeDtypeStruct(y.shape, y.dtype) for y in buffers[n:])
        ys = self._call(
            "jaxdist_nccl_wait_group", outs, *buffers, aliases={n + i: i for i in range(n)}, op_id=params[0]["op_id"]
        )
        return tuple(_typed(self._unlayout(kind, y, p), p["result_axes"]) for y, p in zip(ys, params, strict=True))

    def issued(self, buffers, token):
        # The start's outputs exist once NCCL is enqueued on the side stream, so this ties
        # the token to the issue (not to completion) at no cost.
        return sequence(buffers, token)

    def check_handle(self, handle) -> None:
        if handle.crossed_boundary():
            raise ValueError(
                f"wait: this nccl {handle.op} handle crossed a scan/while/jit boundary (or was rebuilt from its "
                "pytree leaves) between its start and this wait. XLA may copy such a buffer before NCCL has "
                "written it, which would read stale data. Wait in the same loop iteration (jaxdist's own unit "
                "loops unroll for this backend), or use backend='xla'."
            )

    def finish(self, kind, buffers, axis_name, params):
        x_alias, y = buffers
        out = jax.ShapeDtypeStruct(y.shape, y.dtype)
        y = self._call("jaxdist_nccl_wait", out, x_alias, y, aliases={1: 0}, op_id=params["op_id"])
        return _typed(self._unlayout(kind, y, params), params["result_axes"])


def _result_axes(kind: str, x, axis_name) -> tuple[str, ...]:
    """The manual axes a result varies over under `shard_map(check_vma=True)`, as the xla backend's
    `jax.lax` op types it: an all-reduce is invariant over its axes, every other op varies over them."""
    names, vma = set(as_axis_names(axis_name)), varying_axes(x)
    return tuple(sorted(vma - names if kind == "all_reduce" else vma | names))


def _typed(y, axes: tuple[str, ...]):
    """`ffi_call` types its results invariant over every axis: cast `y` to vary over `axes` (no
    communication; the identity without check_vma)."""
    missing = tuple(a for a in axes if a not in varying_axes(y))
    return jax.lax.pcast(y, missing, to="varying") if missing else y


@functools.cache
def nccl_backend() -> NcclBackend:
    """The nccl backend; raises a clear error where it cannot work."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        raise RuntimeError("the 'nccl' comm backend needs CUDA GPUs and none are visible; use backend='xla'")
    load()
    return NcclBackend()
