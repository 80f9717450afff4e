"""The array files checkpoints are written as (`jaxdist.train.array_files`): a save spread over files of about
equal size (large arrays split by rows), each piece's CRC-32 summed while written equal to zlib's over the
file, values and dtypes exact when read back onto other shardings, and a damaged or incomplete set of
files refused by name. No training: plain arrays on the 8 CPU devices."""

import json
import os
import threading
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import safe_open

from jaxdist.train import array_files


@pytest.fixture(scope="module")
def values():
    rng = np.random.default_rng(0)
    return {
        "params": {
            "big": rng.normal(size=(600, 40)).astype(np.float32),
            "sharded": rng.normal(size=(64, 24)).astype(np.float32),
            "blocks": [{"w": rng.normal(size=(5, 3)).astype(jnp.bfloat16)} for _ in range(12)],
        },
        "count": np.int32(7),
        "mask": rng.integers(0, 2, (9,)).astype(bool),
        "empty": np.zeros((0, 4), np.float32),
        "key": rng.integers(0, 2**32, (2,), dtype=np.uint64).astype(np.uint32),
    }


def _mesh(shape, names):
    if len(jax.devices()) < np.prod(shape):  # a one-GPU runner: the CPU suite's 8 devices are not there
        pytest.skip(f"needs {np.prod(shape)} devices of the default backend, found {len(jax.devices())}")
    return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])


@pytest.fixture(scope="module")
def written(values, tmp_path_factory, monkeypatch_module):
    """`values` placed on 8 devices (one array split 4 x 2, the rest replicated), written with small files and
    pieces: several files, large arrays split by rows, pieces spanning arrays."""
    monkeypatch_module.setattr(array_files, "FILE_BYTES", 8 << 10)
    monkeypatch_module.setattr(array_files, "_workers", lambda: 4)
    mesh = _mesh((4, 2), ("a", "b"))
    tree = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), values)
    tree["params"]["sharded"] = jax.device_put(values["params"]["sharded"], NamedSharding(mesh, P("a", "b")))
    directory = tmp_path_factory.mktemp("arrays")
    return directory, array_files.write_arrays(directory, tree, chunk_bytes=4096)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_a_save_spreads_over_files_of_about_equal_size(written):
    directory, out = written
    sizes = [size for size, _ in out.sums.values()]
    assert len(sizes) == 4 and sorted(p.name for p in directory.iterdir()) == sorted(out.sums)
    assert max(sizes) < 1.5 * min(sizes)  # the 96 KB array split by rows; no file waits on one large array


def test_each_piece_checksum_is_zlibs_crc_of_the_file(written):
    directory, out = written
    for name, (size, crcs) in out.sums.items():
        raw = (directory / name).read_bytes()
        assert len(raw) == size
        assert crcs == [zlib.crc32(raw[i : i + 4096]) for i in range(0, len(raw), 4096)]


def test_values_and_dtypes_read_back_onto_other_shardings(written, values):
    directory, _ = written
    mesh = _mesh((2, 4), ("x", "y"))
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), values)
    shardings["params"]["big"] = NamedSharding(mesh, P(("x", "y")))  # rows that cross the saved row pieces
    shardings["params"]["sharded"] = NamedSharding(mesh, P("y", "x"))  # other cuts than the saved shards
    target = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=s), values, shardings
    )
    restored = array_files.restore_arrays(directory, target)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(values), strict=True):
        assert got.dtype == np.asarray(want).dtype, path
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(path))
    assert restored["params"]["sharded"].sharding == shardings["params"]["sharded"]


def test_the_files_are_safetensors_and_read_tree_joins_the_slices(written, values):
    directory, _ = written
    keys = []
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), framework="numpy") as f:
            keys += list(f.keys())
    assert "count" in keys and "params/blocks/11/w" in keys
    assert "params/sharded@0:16,0:12" in keys and "params/sharded" not in keys  # a shard, by its box
    tree = array_files.read_tree(directory, "params")
    assert sorted(tree) == ["big", "blocks", "sharded"] and sorted(tree["blocks"], key=int) == [
        str(i) for i in range(12)
    ]
    np.testing.assert_array_equal(tree["big"], values["params"]["big"])
    np.testing.assert_array_equal(tree["sharded"], values["params"]["sharded"])


def test_a_leaf_of_another_shape_or_missing_is_refused_by_name(written, values):
    directory, _ = written
    wrong = {"params": {"big": jax.ShapeDtypeStruct((600, 41), np.float32)}}
    with pytest.raises(
        ValueError, match="params/big was saved as float32\\[600, 40\\], the run has float32\\[600, 41\\]"
    ):
        array_files.restore_arrays(directory, wrong)
    with pytest.raises(ValueError, match="params/other is not in the checkpoint"):
        array_files.restore_arrays(directory, {"params": {"other": jax.ShapeDtypeStruct((1,), np.float32)}})


def test_a_missing_file_is_an_incomplete_leaf_not_wrong_values(written, tmp_path):
    directory, out = written
    kept = tmp_path / "kept"
    kept.mkdir()
    names = sorted(out.sums)
    for name in names[1:]:  # one of the files lost
        (kept / name).write_bytes((directory / name).read_bytes())
    files = array_files.ArrayFiles(kept)
    incomplete = [name for name in files.leaves if name not in files.blobs or _cover(files, name) < _size(files, name)]
    assert incomplete  # the lost file held pieces of some leaves
    with pytest.raises(ValueError, match="is incomplete"):
        for name in files.leaves:
            files.read(name)


def _size(files, name):
    return int(np.prod(files.shape_dtype(name)[0]))


def _cover(files, name):
    return sum(int(np.prod([b - a for a, b in stored.box])) for stored in files.blobs.get(name, ()))


def test_a_process_holding_no_shard_of_replica_0_writes_one_file_of_no_tensors(values, tmp_path, monkeypatch):
    """The second dp row of HSDP over two processes holds only replicas 1+: its save writes one file that
    holds no tensors (it raised before, and the other process waited for it forever)."""
    monkeypatch.setattr(jax, "process_index", lambda: 1)  # NumPy leaves are process 0's to write
    written = array_files.write_arrays(tmp_path, values)
    assert list(written.sums) == ["arrays.1.0.safetensors"]
    with safe_open(tmp_path / "arrays.1.0.safetensors", framework="numpy") as f:
        assert list(f.keys()) == []


def test_a_files_writes_start_before_the_values_later_in_it_are_in_host_memory(tmp_path, monkeypatch):
    """A value is taken when its file's writes reach it: a copy into host memory still in flight holds back
    only the bytes after it. Here the int8 array, laid out last, becomes readable only once the file's
    first piece is written; a writer that waited for every value first would never write that piece."""
    first_write = threading.Event()
    pwritev = os.pwritev

    def pwritev_then_signal(*args):
        written = pwritev(*args)
        first_write.set()
        return written

    get = array_files._HostValue.get

    def get_late_after_a_write(self):
        if self.source is not None and np.dtype(self.source.dtype) == np.int8:
            assert first_write.wait(timeout=30), "the file's first piece was not written before its last value"
        return get(self)

    monkeypatch.setattr(array_files, "FILE_BYTES", 32 << 20)  # one file (the module's fixture sets smaller files)
    monkeypatch.setattr(array_files.os, "pwritev", pwritev_then_signal)
    monkeypatch.setattr(array_files._HostValue, "get", get_late_after_a_write)
    tree = {"early": jnp.arange(16384, dtype=jnp.float32), "late": jnp.arange(100, dtype=jnp.int8)}
    written = array_files.write_arrays(tmp_path, tree, chunk_bytes=4096)
    assert len(written.sums) == 1
    restored = array_files.restore_arrays(
        tmp_path, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    )
    for name in tree:
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(tree[name]))


def test_a_scalar_is_stored_with_no_dimensions_and_a_split_blob_splits_again_by_its_own_rows(tmp_path):
    """A scalar's safetensors entry has shape () (not (1,)); splitting rows that were split before takes
    the rows its name says."""
    tree = {"step": jnp.int32(7), "w": jnp.arange(40.0, dtype=jnp.float32).reshape(10, 4)}
    array_files.write_arrays(tmp_path, tree)
    (file,) = tmp_path.glob("*.safetensors")
    with safe_open(file, "np") as f:
        assert f.get_tensor("step").shape == ()
    blobs, _ = array_files._local_blobs({"w": np.arange(40.0, dtype=np.float32).reshape(10, 4)})
    (late,) = [b for b in array_files._split_rows(blobs[0], 6 * 16) if b.key.endswith("@6:10,0:4")]
    (part,) = [b for b in array_files._split_rows(late, 2 * 16) if b.key.endswith("@8:10,0:4")]
    np.testing.assert_array_equal(part.value(), np.arange(32.0, 40.0).reshape(2, 4))


def test_a_files_arrays_of_one_item_size_are_laid_out_in_the_trees_order(tmp_path):
    """A packed host copy's runs arrive in the tree's order: each file's writes begin with the first to
    arrive. Wider items still come first (alignment)."""
    tree = {f"w{i:02d}": jnp.full((50 + 70 * (i % 5),), i, jnp.float32) for i in range(12)}
    tree["a_half"] = jnp.ones(300, jnp.bfloat16)  # first in the tree, laid out after every float32
    array_files.write_arrays(tmp_path, tree)
    (file,) = tmp_path.glob("*.safetensors")
    raw = file.read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    by_offset = sorted((entry["data_offsets"][0], name) for name, entry in header.items() if name != "__metadata__")
    assert [name for _, name in by_offset] == [f"w{i:02d}" for i in range(12)] + ["a_half"]


def test_a_piece_is_summed_on_the_writers_thread_once_the_pools_take_no_work():
    """At the interpreter's exit thread pools refuse new work: a file's pieces are then summed where it is written."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1)
    pool.shutdown()
    views = [memoryview(b"the first part, "), memoryview(b"then the rest")]
    assert array_files._sum_beside(pool, views).result() == zlib.crc32(b"the first part, then the rest")
