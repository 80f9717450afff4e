"""Adversarial models for the pipeline (`jaxdist.pipeline.Pipelined`) against one device.

The models of tests/support/models.py (sizes pp does not divide, scalar and size-1
parameters, a weight tied between the embed on the first stage and the head on the last), SGD with
momentum after an active global-norm clip, and the documented restrictions as clear errors.
"""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.models import (
    ODD_PLAN,
    ODD_UNITS,
    TIED_UNITS,
    OddMLP,
    TiedModel,
    odd_batches,
    odd_loss,
    tied_batches,
    tied_loss,
)
from support.optimizers import clipped_momentum
from support.reference import assert_same_training, train_single_device
from support.runs import train

from jaxdist.pipeline.run import Pipelined

STEPS = 3


@pytest.mark.parametrize(
    ("shape", "names", "options", "model"),
    [
        # 1F1B over pp2 x dp4 trains odd blocks (leaves split over pp beside a scalar gate and a size-1 shift) as one
        # device in the fast run in the tied-weight test below; sizes nothing divides under the active clip in
        # pp2xfsdp2xtp2-gpipe
        pytest.param(
            (2, 4), ("pp", "dp"), dict(microbatches=2), dict(d=8, hidden=13, layers=4), marks=pytest.mark.slow
        ),
        (
            (2, 2, 2),
            ("pp", "fsdp", "tp"),
            dict(microbatches=4, schedule="gpipe", plan=ODD_PLAN),
            dict(hidden=6, layers=2),
        ),
        # interleaved trains as one device in the fast run in tests/pipeline/test_pipeline.py (the GPT, tied)
        pytest.param(
            (2, 4),
            ("pp", "dp"),
            dict(microbatches=2, schedule="interleaved", virtual=2),
            dict(layers=4),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["pp2xdp4-1f1b", "pp2xfsdp2xtp2-gpipe", "pp2xdp4-interleaved"],
)
def test_pipeline_trains_an_mlp_of_odd_sizes_as_one_device(shape, names, options, model):
    """Block leaves split over pp where a dimension divides, replicated (the scalar gate, the size-1
    shift, 7 x 13 kernels) where none does; clipped SGD with momentum and grad_norm are exact."""

    def make():
        return OddMLP(nnx.Rngs(0), **model)

    data = odd_batches(STEPS)
    want = train_single_device(make, odd_loss, data, clipped_momentum())
    assert min(want[2]) > 0.05  # the clip is active
    run = Pipelined(cpu_mesh(shape, names), **options).prepare(make(), clipped_momentum(), ODD_UNITS, data[0])
    assert_same_training(train(run, data), want)


def test_pipeline_sums_a_tied_weights_gradients_from_the_first_and_last_stage():
    data = tied_batches(STEPS)
    opt = optax.sgd(0.1, momentum=0.9)
    want = train_single_device(lambda: TiedModel(nnx.Rngs(0)), tied_loss, data, opt)
    run = Pipelined(cpu_mesh((2, 4), ("pp", "dp")), microbatches=2).prepare(
        TiedModel(nnx.Rngs(0)), opt, TIED_UNITS, data[0]
    )
    assert_same_training(train(run, data), want)


def test_pipeline_restrictions_are_clear_errors():
    data = odd_batches(1)[0]  # 16 rows: 4 per data rank of pp2 x dp4
    mesh = cpu_mesh((2, 4), ("pp", "dp"))
    with pytest.raises(ValueError, match="4 rows do not split into microbatches=3"):
        Pipelined(mesh, microbatches=3).prepare(OddMLP(nnx.Rngs(0), layers=2), optax.sgd(0.1), ODD_UNITS, data)
    with pytest.raises(ValueError, match="3 blocks do not split"):
        Pipelined(mesh, microbatches=2).prepare(OddMLP(nnx.Rngs(0), layers=3), optax.sgd(0.1), ODD_UNITS, data)
    with pytest.raises(ValueError, match="pp"):
        Pipelined(cpu_mesh((8,), ("dp",)), microbatches=2)
    with pytest.raises(ValueError, match="divisible"):
        Pipelined(mesh, microbatches=2).prepare(
            OddMLP(nnx.Rngs(0), layers=2), optax.sgd(0.1), ODD_UNITS, odd_batches(1, rows=6)[0]
        )
    # a constant table a block holds: named, with what to do (the message spoke of dropout and BatchNorm only)
    with_table = OddMLP(nnx.Rngs(0), layers=2)
    with_table.layers[0].table = jnp.arange(3.0)
    said = "non-parameter variables \\(layers/0/table \\(an array\\)\\).*compute a table"
    with pytest.raises(ValueError, match=said):
        Pipelined(mesh, microbatches=2).prepare(with_table, optax.sgd(0.1), ODD_UNITS, data)
    np.testing.assert_equal(len(Pipelined(mesh, microbatches=2).table().ticks) > 0, True)
