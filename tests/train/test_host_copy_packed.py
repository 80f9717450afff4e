"""`start_host_copy(pack=True)`: the arrays that lie whole on one device travel to host memory packed
in a few buffers, and each comes back as a view of its own bytes; the rest are copied one by one as
before. A checkpoint of such a copy restores every value bit for bit."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxdist.train import checkpoint
from jaxdist.train.checkpoint import Checkpoints
from jaxdist.train.host_copy import HostSlice, host_memory_kind, start_host_copy, wait_for_host_copy


def _one_device_values() -> dict:
    """Arrays of every packable kind whose sizes are not multiples of the packing's alignment."""
    return {
        "f32": np.array(
            [[1.5, -0.0, np.nan, np.inf, -np.inf], [3e-38, 1e-45, 7.0, -2.5, 1e30], [0, 1, 2, 3, 4]], np.float32
        ),
        "bf16": np.arange(7, dtype=np.float32).astype(ml_dtypes.bfloat16) - 3,
        "f16": np.array([[0.5, -1.0], [65504.0, 6e-8]], np.float16),
        "step": np.array(12345, np.int32),
        "mask": np.array([True, False, True, True, False]),
        "bytes": np.array([0, 255, 7], np.uint8),
        "empty": np.zeros((0, 4), np.float32),
        "u32": np.array([2**32 - 1, 0, 17], np.uint32),
        "f8": np.array([0.5, -448.0, 3.0], ml_dtypes.float8_e4m3fn),
    }


def _bits(x) -> np.ndarray:
    x = np.ascontiguousarray(x)
    return x.reshape(-1).view(np.uint8) if x.size else x.reshape(-1)


def test_a_packed_copy_holds_each_arrays_bytes_and_copies_the_others_one_by_one():
    values = _one_device_values()
    device = jax.devices()[0]
    kind = host_memory_kind(device)
    tree = {name: jax.device_put(v, device) for name, v in values.items()}
    tree["on_host"] = jax.device_put(np.arange(3.0), jax.sharding.SingleDeviceSharding(device, memory_kind=kind))
    apart = ["on_host"]
    if len(jax.devices()) >= 2:  # (a GPU runner with one GPU has one device of the default backend)
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
        tree["split"] = jax.device_put(np.arange(8.0), jax.sharding.NamedSharding(mesh, jax.P("x")))
        apart.append("split")
    tree["numpy"], tree["count"] = np.ones(3), 4

    copy = start_host_copy(tree, pack=True)
    wait_for_host_copy(copy)

    packed = {name for name, x in copy.items() if isinstance(x, HostSlice)}
    assert packed == set(values)  # every one-device array in device memory, and nothing else
    assert len({id(copy[name].packed) for name in packed}) == 1  # one transfer for all of them
    for name, value in values.items():
        got = np.asarray(copy[name])
        assert got.shape == value.shape and got.dtype == value.dtype, name
        np.testing.assert_array_equal(_bits(got), _bits(value), err_msg=name)
    for name in apart:  # copied by themselves, into host memory
        assert isinstance(copy[name], jax.Array) and copy[name].sharding.memory_kind == kind
        np.testing.assert_array_equal(np.asarray(copy[name]), np.asarray(tree[name]))
    assert copy["numpy"] is tree["numpy"] and copy["count"] == 4


def test_a_single_array_or_a_copy_without_pack_is_a_jax_array():
    device = jax.devices()[0]
    assert isinstance(start_host_copy({"w": jnp.ones(3)}, pack=True)["w"], jax.Array)  # nothing to pack it with
    unpacked = start_host_copy({"w": jnp.ones(3), "b": jnp.zeros(2)})
    assert all(
        isinstance(x, jax.Array) and x.sharding.memory_kind == host_memory_kind(device) for x in unpacked.values()
    )


def test_packed_copies_are_taken_per_device():
    """A state on several devices of one process (here: each leaf on a device of its own) packs per device."""
    devices = jax.devices()[:2]
    if len(devices) < 2:
        pytest.skip(f"needs 2 devices of the default backend, found {len(devices)}")
    tree = {f"w{i}": jax.device_put(np.full(5, i, np.float32), devices[i % 2]) for i in range(4)}
    copy = start_host_copy(tree, pack=True)
    by_device = {}
    for i in range(4):
        by_device.setdefault(i % 2, set()).add(id(copy[f"w{i}"].packed))
    assert all(len(ids) == 1 for ids in by_device.values()) and by_device[0] != by_device[1]
    for i in range(4):
        np.testing.assert_array_equal(np.asarray(copy[f"w{i}"]), np.full(5, i, np.float32))


@pytest.mark.parametrize("axes", ["auto", "explicit"])
def test_a_packed_copy_inside_a_callers_mesh_context(axes):
    """Inside a user's `jax.set_mesh` of 8 devices (Auto or Explicit axes) a state replicated over them, or
    made there without a sharding, packs on one device as outside it."""
    if len(jax.devices()) < 8:
        pytest.skip(f"needs 8 devices of the default backend, found {len(jax.devices())}")
    kind = jax.sharding.AxisType.Auto if axes == "auto" else jax.sharding.AxisType.Explicit
    mesh = jax.make_mesh((8,), ("dp",), axis_types=(kind,))
    replicated = jax.sharding.NamedSharding(mesh, jax.P())
    with jax.set_mesh(mesh):
        tree = {"w": jax.device_put(np.arange(12.0, dtype=np.float32), replicated), "made_here": jnp.ones(5)}
        tree["one_device"] = jax.device_put(np.arange(3, dtype=np.int32), jax.devices()[0])
        copy = start_host_copy(tree, pack=True)
        wait_for_host_copy(copy)
    assert all(isinstance(x, HostSlice) for x in copy.values())
    np.testing.assert_array_equal(np.asarray(copy["w"]), np.arange(12.0, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(copy["made_here"]), np.ones(5, np.float32))
    np.testing.assert_array_equal(np.asarray(copy["one_device"]), np.arange(3, dtype=np.int32))


def test_a_device_without_room_for_the_packed_buffer_copies_its_arrays_one_by_one(monkeypatch):
    """Packing takes device memory the size of the arrays packed: where the device has none left, the save
    goes on as before packing, array by array (a save that fitted before packing still fits)."""
    from jaxdist.train import host_copy

    def no_room(arrays):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1493794176 bytes.")

    monkeypatch.setattr(host_copy, "_pack", no_room)
    tree = {"a": jnp.arange(4.0), "b": jnp.zeros(2, jnp.int32)}
    copy = start_host_copy(tree, pack=True)
    assert all(isinstance(x, jax.Array) for x in copy.values())
    wait_for_host_copy(copy)
    np.testing.assert_array_equal(np.asarray(copy["a"]), np.arange(4.0, dtype=np.float32))

    def broken(arrays):
        raise RuntimeError("INTERNAL: something else")

    monkeypatch.setattr(host_copy, "_pack", broken)  # any other failure is the caller's to report
    with pytest.raises(RuntimeError, match="INTERNAL"):
        start_host_copy(tree, pack=True)


def test_a_host_slice_converts_as_an_array_does():
    """`np.asarray`: a read-only view of the packed bytes; `np.array`: a writable copy of its own; another
    dtype only by a copy."""
    copy = start_host_copy({"a": jnp.arange(4.0), "b": jnp.zeros(2)}, pack=True)
    view, own = np.asarray(copy["a"]), np.array(copy["a"])
    assert not view.flags.writeable and not np.shares_memory(view, own)
    own[0] = 100.0  # its own memory: the packed bytes stay as they were
    np.testing.assert_array_equal(np.asarray(copy["a"]), np.arange(4.0, dtype=np.float32))
    assert np.asarray(copy["a"], dtype=np.float64).dtype == np.float64
    with pytest.raises(ValueError, match="only by a copy"):
        np.asarray(copy["a"], dtype=np.float64, copy=False)


def test_warm_up_copies_nothing_where_saves_make_no_host_copy(tmp_path, monkeypatch):
    """Compressed saves of several processes let orbax transfer what it writes: the warm-up then reads nothing."""
    read = []
    monkeypatch.setattr(checkpoint, "wait_for_host_copy", read.append)
    monkeypatch.setattr(Checkpoints, "_copies_to_host", lambda self: False)
    ckpt = Checkpoints(tmp_path, keep=1, compress=True)
    ckpt.warm_up({"w": jnp.ones(3), "b": jnp.zeros(2)})
    ckpt.close()
    assert read == []


@pytest.mark.parametrize("compress", [False, True])
def test_a_checkpoint_of_mixed_dtypes_restores_bit_for_bit(tmp_path, monkeypatch, compress):
    """Saves of the array files pack the state; compressed saves copy it array by array: both restore exactly."""
    packs = []
    real = checkpoint.start_host_copy

    def copy(tree, **options):
        packs.append(options.get("pack"))
        return real(tree, **options)

    monkeypatch.setattr(checkpoint, "start_host_copy", copy)
    values = _one_device_values()
    if compress:
        del values["empty"]  # orbax's zarr arrays refuse a zero-size array
    device = jax.devices()[0]
    state = {name: jax.device_put(v, device) for name, v in values.items()}
    ckpt = Checkpoints(tmp_path, keep=1, compress=compress, pack=True)  # (on a CPU backend saves do not pack)
    ckpt.save(1, state, {"step": 1})
    ckpt.wait()
    assert packs == [not compress]
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    restored = ckpt.restore(1, target)
    ckpt.close()
    for name, value in values.items():
        got = np.asarray(restored[name])
        assert got.dtype == value.dtype and got.shape == value.shape, name
        np.testing.assert_array_equal(_bits(got), _bits(value), err_msg=name)


def test_saves_pack_by_default_only_off_the_cpu(tmp_path):
    """On a CPU backend the packing is one more copy in host memory: saves copy array by array there."""
    ckpt = Checkpoints(tmp_path, keep=1)
    assert ckpt.pack is (jax.default_backend() != "cpu")
    ckpt.close()


def test_a_packed_copy_travels_in_runs_of_about_pack_chunk_bytes_in_the_trees_order(tmp_path, monkeypatch):
    """A device's arrays are packed into buffers of about `PACK_CHUNK_BYTES` in the tree's order, an array
    never split (one larger than that travels alone), each buffer its own transfer: a checkpoint's writer
    starts on the first while the later ones are on their way. The runs compile once, and a checkpoint of
    them restores bit for bit."""
    from jaxdist.train import host_copy

    monkeypatch.setattr(host_copy, "PACK_CHUNK_BYTES", 256)
    sizes = [10, 20, 30, 100, 5, 40, 3]  # float32 values; padded to 64 bytes: 64, 128, 128, 448, 64, 192, 64
    device = jax.devices()[0]
    values = [np.arange(n, dtype=np.float32) + 1000 * i for i, n in enumerate(sizes)]
    tree = [jax.device_put(v, device) for v in values]
    copy = start_host_copy(tree, pack=True)
    runs = []
    for i, x in enumerate(copy):
        if runs and x.packed is copy[runs[-1][-1]].packed:
            runs[-1].append(i)
        else:
            runs.append([i])
    assert runs == [[0, 1], [2], [3], [4, 5], [6]]
    assert len({id(x.packed) for x in copy}) == len(runs)  # a run's arrays, and only they, share a buffer
    for got, value in zip(copy, values, strict=True):
        np.testing.assert_array_equal(np.asarray(got), value)

    compiled = host_copy._pack._cache_size()
    again = start_host_copy([x + 1 for x in tree], pack=True)
    assert host_copy._pack._cache_size() == compiled
    np.testing.assert_array_equal(np.asarray(again[3]), values[3] + 1)

    ckpt = Checkpoints(tmp_path, keep=1, pack=True)
    ckpt.save(1, tree, {"step": 1})
    ckpt.wait()
    restored = ckpt.restore(1, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in tree])
    ckpt.close()
    for got, value in zip(restored, values, strict=True):
        np.testing.assert_array_equal(np.asarray(got), value)
