"""`pack_units=False`: each unit's gather and gradient reduction as grouped collectives over its
pieces themselves (`jaxdist.comm` groups), no packing into flat buffers. Checked against an independent
single-device run with a scale-sensitive optimizer (an active global-norm clip, then SGD with momentum)
and the gradient norm, on every kind of storage the engine has, and by the compiled step: the packed
step concatenates pieces into buffers, the grouped one never does."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from support.meshes import cpu_mesh
from support.models import ODD_PLAN, ODD_UNITS, OddMLP, odd_batches, odd_loss
from support.optimizers import clipped_momentum
from support.reference import assert_same_training, train_single_device
from support.runs import train

from jaxdist import comm
from jaxdist.engine.run import Parallel
from jaxdist.pipeline.run import Pipelined
from jaxdist.pipeline.stage_step import mean_over

STEPS = 3


def make():
    # sizes nothing divides (7, 13 -> 6 for tp), size-1 and scalar parameters; 4 blocks for 2 stages
    return OddMLP(nnx.Rngs(0), hidden=6, layers=4)


@pytest.fixture(scope="module")
def one_device():
    return train_single_device(make, odd_loss, odd_batches(STEPS), clipped_momentum())


STRATEGIES = {
    "fsdp8": lambda: Parallel(cpu_mesh((8,), ("fsdp",)), pack_units=False),
    "hsdp2x4-keep-gathered": lambda: Parallel(
        cpu_mesh((2, 4), ("dp", "fsdp")), reshard_after_forward=False, pack_units=False
    ),
    "zero1-8": lambda: Parallel(cpu_mesh((8,), ("dp",)), pack_units=False),
    "dp2xfsdp2xtp2": lambda: Parallel(cpu_mesh((2, 2, 2), ("dp", "fsdp", "tp")), plan=ODD_PLAN, pack_units=False),
    "pp2xfsdp4": lambda: Pipelined(cpu_mesh((2, 4), ("pp", "fsdp")), microbatches=2, pack_units=False),
}


def concatenations(run, batch) -> int:
    text = run.step.lower(run.state, batch).compile().as_text()
    return len(re.findall(r"= \S+ concatenate\(", text))


# fsdp8 is slow: dp2xfsdp2xtp2 reduce-scatters over fsdp and all-reduces over dp in one step
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow if n == "fsdp8" else ()) for n in STRATEGIES])
def test_grouped_units_train_as_one_device(one_device, name):
    run = STRATEGIES[name]().prepare(make(), clipped_momentum(), ODD_UNITS, odd_batches(1)[0])
    got = train(run, odd_batches(STEPS))
    assert min(one_device.grad_norms) > 0.05  # the clip is active: a gradient off by any factor shows
    assert_same_training(got, one_device)


def test_the_grouped_step_packs_nothing_where_the_packed_one_does():
    batch = odd_batches(1)[0]
    mesh = cpu_mesh((2, 4), ("dp", "fsdp"))
    packed = Parallel(mesh).prepare(make(), clipped_momentum(), ODD_UNITS, batch)
    grouped = Parallel(mesh, pack_units=False).prepare(make(), clipped_momentum(), ODD_UNITS, batch)
    assert concatenations(packed, batch) > 0  # the probe sees the packing copies where they are
    assert concatenations(grouped, batch) == 0


def test_a_grouped_pipeline_step_concatenates_less_than_a_packed_one():
    """The pipeline's gather of the stored pieces and its stage gradients' all-reduce over dp are groups
    too (the next test pins the latter); its messages between stages stay packed either way."""
    batch = odd_batches(1)[0]
    mesh = cpu_mesh((2, 4), ("pp", "dp"))
    counts = {}
    for pack in (True, False):
        run = Pipelined(mesh, microbatches=2, pack_units=pack).prepare(make(), clipped_momentum(), ODD_UNITS, batch)
        counts[pack] = concatenations(run, batch)
    assert counts[True] > counts[False], counts


def test_the_pipelines_stage_gradients_are_averaged_over_dp_as_one_group_in_place():
    """`mean_over(pack=False)` (the pipeline's stage-gradient reduction): the mean over the data axis of
    arrays of two dtypes and odd shapes, the packed form's values, with no concatenation."""
    mesh = cpu_mesh((8,), ("dp",))
    rng = np.random.default_rng(0)
    tree = {
        0: rng.normal(size=(8, 3, 5)).astype(np.float32),
        1: rng.normal(size=(8, 7)).astype(jnp.bfloat16),
        2: rng.normal(size=(8, 4)).astype(np.float32),  # two float32 arrays: the packed form concatenates them
    }
    tree = jax.device_put(tree, jax.sharding.NamedSharding(mesh, P("dp")))

    def body(pack):
        def f(t):
            out, _ = mean_over({k: x[0] for k, x in t.items()}, ("dp",), comm.token(), "xla", pack=pack)
            return {k: x[None] for k, x in out.items()}

        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"), check_vma=False))

    grouped, packed = body(False), body(True)
    assert "concatenate" not in str(jax.make_jaxpr(grouped)(tree))
    assert "concatenate" in str(jax.make_jaxpr(packed)(tree))  # the probe sees packing where it is
    got, want = grouped(tree), packed(tree)
    for k, x in tree.items():
        np.testing.assert_array_equal(np.asarray(got[k], np.float32), np.asarray(want[k], np.float32))
        mean = np.asarray(x, np.float64).mean(axis=0)
        np.testing.assert_allclose(
            np.asarray(got[k], np.float64)[3], mean, rtol=1e-2 if k == 1 else 1e-6, atol=1e-2 if k == 1 else 1e-6
        )
