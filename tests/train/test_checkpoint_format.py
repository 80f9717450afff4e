"""Checkpoints written in orbax's default form (zarr v2 arrays and a `_sharding` file, as jaxdist wrote before
its saves took zarr v3 arrays in 64 MiB data files without the sharding file, and then its own array files)
restore, and the array files round-trip, values and dtypes exact, readable by safetensors alone."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors import safe_open

from jaxdist.train.checkpoint import Checkpoints


def tree():
    rng = np.random.default_rng(0)
    return {
        "params": {"w": jnp.asarray(rng.normal(size=(64, 8)), jnp.float32), "b": jnp.arange(5, dtype=jnp.bfloat16)},
        "step": jnp.asarray(7, jnp.int32),
    }


def target(values):
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), values)


def save_in_orbax_default_form(directory, values):
    handlers = {"state": ocp.PyTreeCheckpointHandler(use_compression=False), "meta": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(directory / "checkpoints", item_handlers=handlers) as manager:
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(values), meta=ocp.args.JsonSave({"step": 3}))
        manager.save(3, args=args)
        manager.wait_until_finished()


@pytest.mark.parametrize("form", ["orbax-default", "jaxdist"])
def test_checkpoint_restores_exactly_in_either_form(tmp_path, form):
    values = tree()
    ckpt = Checkpoints(tmp_path, keep=2) if form == "jaxdist" else None
    if ckpt is None:
        save_in_orbax_default_form(tmp_path, values)
        ckpt = Checkpoints(tmp_path, keep=2)
    else:
        ckpt.save(3, values, {"step": 3})
        ckpt.wait()
    item = ckpt.directory / "3" / ("state" if form == "orbax-default" else "arrays")
    written = {p.name for p in item.iterdir()}
    assert ("_sharding" in written) == (form == "orbax-default")  # a restore reads onto the target's shardings
    if form == "jaxdist":  # a small state: one safetensors file of this process, each leaf by its path
        with safe_open(str(item / "arrays.0.0.safetensors"), framework="numpy") as f:
            assert sorted(f.keys()) == ["params/b", "params/w", "step"]
            np.testing.assert_array_equal(f.get_tensor("params/w"), np.asarray(values["params"]["w"]))
    try:
        step, restored = ckpt.newest_readable(lambda s: ckpt.restore(s, target(values)))
        assert step == 3 and ckpt.meta(3)["step"] == 3
    finally:
        ckpt.close()
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(values), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
