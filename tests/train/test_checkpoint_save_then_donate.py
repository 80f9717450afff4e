"""`Checkpoints.save` returns once the copies into host memory are enqueued, before they are done: a
step that donates and overwrites the very arrays handed to `save` right after must still leave the
checkpoint holding the values of the moment `save` was called, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist.train.checkpoint import Checkpoints
from jaxdist.train.host_copy import host_memory_kind, start_host_copy

SIZE = 1 << 22  # 16 MiB per float32 array: copies long enough to be in flight when the step runs


def _state(sharding) -> dict:
    def make(seed):
        return jax.random.normal(jax.random.key(seed), (SIZE // 1024, 1024), jnp.float32)

    scalar = sharding if isinstance(sharding, jax.sharding.SingleDeviceSharding) else sharding.update(spec=jax.P())
    shardings = {f"w{i}": sharding for i in range(3)} | {"step": scalar}
    make_all = jax.jit(lambda: {f"w{i}": make(i) for i in range(3)} | {"step": jnp.int32(7)}, out_shardings=shardings)
    return jax.block_until_ready(make_all())


@jax.jit
def _overwrite(tree):
    return jax.tree.map(lambda a: -a - 1, tree)


_overwrite_donating = jax.jit(_overwrite.__wrapped__, donate_argnums=0)


def _shardings():
    # one device of the default backend (on a GPU runner: a real device-to-host DMA); the meshes need 8
    # devices of the default backend (a GPU runner's simulated CPU devices are not: a jit of theirs there
    # does not donate, so the case would check nothing)
    out = {"one device, the run's own arrays": jax.sharding.SingleDeviceSharding(jax.devices()[0])}
    if len(jax.devices()) >= 8:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
        out["replicated on 8 devices"] = jax.sharding.NamedSharding(mesh, jax.P())
        out["split over one axis, replicated over the other"] = jax.sharding.NamedSharding(mesh, jax.P(None, "b"))
    return out


CASES = [
    "one device, the run's own arrays",
    "replicated on 8 devices",
    "split over one axis, replicated over the other",
]


@pytest.mark.parametrize("name", CASES)
def test_a_save_holds_the_values_of_the_call_when_the_next_step_donates_them(tmp_path, name):
    shardings = _shardings()
    if name not in shardings:
        pytest.skip(f"needs 8 devices of the default backend, found {len(jax.devices())}")
    sharding = shardings[name]
    state = _state(sharding)
    expected = jax.tree.map(np.array, state)
    ckpt = Checkpoints(tmp_path, keep=1)
    passed = state
    ckpt.save(1, passed, {})
    state = _overwrite_donating(passed)  # donates the arrays passed to `save` (identity canonical form)
    assert all(x.is_deleted() for x in jax.tree.leaves(passed))
    jax.block_until_ready(state)
    ckpt.wait()
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    restored = ckpt.restore(1, target)
    ckpt.close()
    for key in expected:
        np.testing.assert_array_equal(np.asarray(restored[key]), expected[key], strict=True)
        assert not np.array_equal(np.asarray(state[key]), expected[key])  # the step did overwrite them


def test_the_host_copy_holds_one_replica_in_host_memory():
    shardings = _shardings()
    if "split over one axis, replicated over the other" not in shardings:
        pytest.skip(f"needs 8 devices of the default backend, found {len(jax.devices())}")
    sharding = shardings["split over one axis, replicated over the other"]
    x = jax.device_put(jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16), sharding)
    copy = start_host_copy({"x": x, "n": 3})
    assert copy["n"] == 3
    kind = host_memory_kind(jax.devices()[0])
    assert kind is not None and copy["x"].sharding.memory_kind == kind
    assert len(copy["x"].addressable_shards) == 4  # one per slice along "b", not 8
    np.testing.assert_array_equal(np.asarray(copy["x"]), np.asarray(x))


def test_an_array_already_in_host_memory_is_copied_too():
    """A state kept in host memory (offloaded) is donated like any other: the copy is a buffer of its own."""
    kind = host_memory_kind(jax.devices()[0])
    x = jax.device_put(jnp.arange(1024.0), jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind))
    copy = start_host_copy(x)
    assert copy.unsafe_buffer_pointer() != x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(copy), np.arange(1024.0))


@pytest.mark.parametrize("error", [RuntimeError("RESOURCE_EXHAUSTED: pinned host memory"), KeyboardInterrupt()])
def test_a_save_whose_copies_cannot_start_leaves_nothing_in_flight(tmp_path, monkeypatch, error):
    """A failure to start the host copies (out of pinned memory, a second Ctrl-C) is not a save in
    flight: `latest()` does not report the step (the trainer's final save would skip it), and a failure
    is the one-line CheckpointError."""
    from jaxdist.train import checkpoint as checkpoint_lib

    def fail(tree, **options):
        raise error

    monkeypatch.setattr(checkpoint_lib, "start_host_copy", fail)
    ckpt = Checkpoints(tmp_path, keep=1)
    expected = checkpoint_lib.CheckpointError if isinstance(error, Exception) else KeyboardInterrupt
    with pytest.raises(expected):
        ckpt.save(3, {"w": jnp.ones(4)}, {})
    assert ckpt.pending is None and ckpt.latest() is None
