"""Adversarial models for the unit engine, DDP and FSDP against an independent single-device run.

Each model here is unlike the shipped GPT: sizes that do not divide the device count (7, 13),
biases of size 1, scalar parameters, a loss over a mask whose count of real entries differs per
data rank, tied weights in a custom model, frozen parameters. Every run is compared with
`support.reference.train_single_device` (one `jax.value_and_grad` over the whole global batch on
one device, then the same optax chain on the pure parameter dict) with scale-sensitive optimizers (SGD, SGD with
momentum) after an active global-norm clip, so a gradient off by any factor shows.
"""

import jax
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
    OddBlock,
    OddMLP,
    TiedModel,
    odd_batches,
    odd_loss,
    tied_batches,
    tied_loss,
)
from support.optimizers import clipped_momentum
from support.reference import LOSS_RTOL, assert_same_training, train_single_device
from support.runs import train

from jaxdist.ddp.run import DDP
from jaxdist.engine.fsdp import FSDP
from jaxdist.engine.run import Parallel, Units
from jaxdist.pipeline.run import Pipelined
from jaxdist.tp import plan as tp_plan

STEPS = 3

# -- an MLP with sizes nothing divides, size-1 biases and scalar parameters (support.models) -------


@pytest.fixture(scope="module")
def odd_reference():
    return train_single_device(lambda: OddMLP(nnx.Rngs(0)), odd_loss, odd_batches(STEPS), clipped_momentum())


@pytest.mark.parametrize(
    ("shape", "names", "options"),
    [
        ((8,), ("fsdp",), {}),
        ((2, 4), ("dp", "fsdp"), {"remat": False}),
        ((8,), ("dp",), {"zero1": True}),
        ((8,), ("fsdp",), {"reshard_after_forward": False}),
    ],
    ids=["fsdp8", "hsdp-keep", "zero1", "fsdp-no-reshard"],
)
def test_engine_trains_an_mlp_whose_sizes_nothing_divides(odd_reference, shape, names, options):
    """Sizes 5, 7, 13, 3, 1 and () divide by no data axis: every such leaf stays whole and is
    all-reduced beside the reduce-scattered ones; clipped SGD with momentum is the single device's."""
    run = Parallel(cpu_mesh(shape, names), **options).prepare(
        OddMLP(nnx.Rngs(0)), clipped_momentum(), ODD_UNITS, odd_batches(1)[0]
    )
    got = train(run, odd_batches(STEPS))
    assert min(odd_reference[2]) > 0.05  # the clip is active
    assert_same_training(got, odd_reference)


def test_ddp_zero1_trains_an_mlp_whose_sizes_nothing_divides(odd_reference):
    run = DDP(cpu_mesh((8,), ("dp",)), zero1=True).prepare(
        OddMLP(nnx.Rngs(0)), clipped_momentum(), odd_loss, odd_batches(1)[0]
    )
    assert_same_training(train(run, odd_batches(STEPS)), odd_reference)


def test_ddp_accumulation_with_clipped_momentum_is_one_big_batch(odd_reference):
    run = DDP(cpu_mesh((4,), ("dp",)), zero1=True, accumulation_steps=2).prepare(
        OddMLP(nnx.Rngs(0)), clipped_momentum(), odd_loss, odd_batches(1)[0]
    )
    assert_same_training(train(run, odd_batches(STEPS)), odd_reference)


# -- tensor parallelism on odd sizes --------------------------------------------------------------


def test_tp_on_odd_model_dims_with_an_even_hidden_size_matches_one_device():
    """d=7 (replicated over tp and not divisible by fsdp), hidden 6 split over tp=2 into pieces of 3
    that fsdp=2 cannot split either, scalar gates and size-1 shifts replicated over tp acting on
    whole activations (their gradient must not be summed over tp)."""

    def make():
        return OddMLP(nnx.Rngs(0), hidden=6)

    data = odd_batches(STEPS)
    want = train_single_device(make, odd_loss, data, clipped_momentum())
    for shape, names in (((2, 2, 2), ("dp", "fsdp", "tp")), ((4, 2), ("dp", "tp"))):
        run = Parallel(cpu_mesh(shape, names), plan=ODD_PLAN).prepare(make(), clipped_momentum(), ODD_UNITS, data[0])
        assert_same_training(train(run, data), want)


def test_tp_plan_on_a_hidden_size_tp_does_not_divide_is_a_clear_error():
    with pytest.raises(ValueError, match="13"):
        Parallel(cpu_mesh((4, 2), ("dp", "tp")), plan=ODD_PLAN).prepare(
            OddMLP(nnx.Rngs(0)), optax.sgd(0.1), ODD_UNITS, odd_batches(1)[0]
        )


# -- a masked mean whose count differs per data rank ----------------------------------------------


def masked_batches(n, rows=16, seed=5):
    """Per row a mask of real entries; ranks' row groups hold very different counts (one rank none)."""
    out = []
    rng = np.random.default_rng(seed)
    for _ in range(n):
        mask = (rng.random((rows, 3)) < np.linspace(0.05, 1.0, rows)[:, None]).astype(np.float32)
        mask[:2] = 0.0  # the first data rank (of 8) holds no real entry at all
        mask[-1] = 1.0
        out.append(
            {
                "x": rng.normal(size=(rows, 5)).astype(np.float32),
                "y": rng.normal(size=(rows, 3)).astype(np.float32),
                "mask": mask,
            }
        )
    return out


def masked_loss(model, batch):
    err = (model(batch["x"]) - batch["y"]) ** 2 * batch["mask"]
    return err.sum() / batch["mask"].sum()


def masked_head(m, x, b):
    err = (m.out(x) * m.temperature - b["y"]) ** 2 * b["mask"]
    return err.sum(), b["mask"].sum()


@pytest.mark.parametrize(
    ("shape", "names", "options"),
    [
        ((8,), ("fsdp",), {}),
        ((2, 2, 2), ("dp", "fsdp", "tp"), {"plan": ODD_PLAN}),
        ((8,), ("dp",), {"update_in_backward": True}),
    ],
    ids=["fsdp8", "dp2xfsdp2xtp2", "zero1-update-in-backward"],
)
def test_sum_and_count_is_the_global_mean_over_real_entries(shape, names, options):
    def make():
        return OddMLP(nnx.Rngs(0), hidden=6)

    data = masked_batches(STEPS)
    opt = optax.sgd(0.2, momentum=0.9)
    want = train_single_device(make, masked_loss, data, opt)
    units = Units(embed=ODD_UNITS.embed, head_loss=masked_head, blocks="layers", sum_and_count=True)
    run = Parallel(cpu_mesh(shape, names), **options).prepare(make(), opt, units, data[0])
    assert_same_training(train(run, data), want, check_norms="update_in_backward" not in options)


# -- tied weights in a custom model, frozen parameters --------------------------------------------


@pytest.mark.parametrize(
    ("shape", "names", "options"),
    [((8,), ("fsdp",), {}), ((2, 4), ("dp", "fsdp"), {"update_in_backward": True}), ((8,), ("dp",), {})],
    ids=["fsdp8", "hsdp-update-in-backward", "zero1"],
)
def test_a_weight_tied_between_embed_and_head_gets_both_gradients(shape, names, options):
    data = tied_batches(STEPS)
    opt = optax.sgd(0.1, momentum=0.9)
    want = train_single_device(lambda: TiedModel(nnx.Rngs(0)), tied_loss, data, opt)
    run = Parallel(cpu_mesh(shape, names), **options).prepare(TiedModel(nnx.Rngs(0)), opt, TIED_UNITS, data[0])
    assert_same_training(train(run, data), want, check_norms="update_in_backward" not in options)


def frozen_optimizer(clip: bool):
    """The blocks' `up` layers frozen (set_to_zero), everything else SGD with momentum (clipped)."""

    def label(p):
        return jax.tree_util.tree_map_with_path(lambda kp, _: "frozen" if "up" in str(kp) else "train", p)

    train = optax.sgd(0.2, momentum=0.9)
    frozen = optax.multi_transform({"frozen": optax.set_to_zero(), "train": train}, label)
    return optax.chain(optax.clip_by_global_norm(0.05), frozen) if clip else frozen


@pytest.mark.parametrize("update_in_backward", [False, True])
def test_frozen_parameters_stay_frozen_and_the_rest_train_as_on_one_device(update_in_backward):
    data = odd_batches(STEPS)
    opt = frozen_optimizer(clip=not update_in_backward)  # update_in_backward refuses a global clip
    want = train_single_device(lambda: OddMLP(nnx.Rngs(0)), odd_loss, data, opt)
    run = Parallel(cpu_mesh((2, 4), ("dp", "fsdp")), update_in_backward=update_in_backward).prepare(
        OddMLP(nnx.Rngs(0)), opt, ODD_UNITS, data[0]
    )
    got = train(run, data)
    assert_same_training(got, want, check_norms=not update_in_backward)
    start = nnx.to_pure_dict(nnx.state(OddMLP(nnx.Rngs(0)), nnx.Param))
    np.testing.assert_array_equal(got[1]["layers"][1]["up"]["kernel"], start["layers"][1]["up"]["kernel"])


# -- FSDP wrapper over the same odd model ---------------------------------------------------------


def test_fsdp_wrapper_with_bf16_reduce_dtype_stays_close_and_float32_is_exact(odd_reference):
    run = FSDP(cpu_mesh((8,), ("fsdp",))).prepare(OddMLP(nnx.Rngs(0)), clipped_momentum(), ODD_UNITS, odd_batches(1)[0])
    assert_same_training(train(run, odd_batches(STEPS)), odd_reference)


# -- clear errors for bad input -------------------------------------------------------------------


def test_a_head_that_meets_the_batch_before_a_tp_layer_under_sequence_parallelism_is_a_clear_error():
    """Under sequence parallelism the head gets this tp rank's chunk of the tokens (here the rows)
    while the batch stays whole: `m.out`, not a tp layer, meets `b["y"]` with the wrong row count.
    The documented restriction must be named, not left as a broadcasting error in the user's code."""
    strategy = Parallel(cpu_mesh((4, 2), ("dp", "tp")), plan=ODD_PLAN, sequence_parallel=True)
    with pytest.raises(ValueError, match="the head failed on this tp rank's chunk of the tokens.*first layer must be"):
        strategy.prepare(OddMLP(nnx.Rngs(0), hidden=6), optax.sgd(0.1), ODD_UNITS, odd_batches(1)[0])


class NormedBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.up, self.down = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.relu(self.up(self.bn(x))))


class NormedModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.wte = nnx.Embed(12, 8, rngs=rngs)
        self.blocks = nnx.List([NormedBlock(rngs)])
        self.head = nnx.Linear(8, 12, rngs=rngs)


def test_batchnorm_in_a_block_under_sequence_parallelism_is_a_clear_error():
    """Each tp rank would normalize by its chunk of the tokens: losses 2.486 / 2.648 against one
    device's 2.464 / 2.604, trained on without a word. Without sequence parallelism it is exact."""
    units = Units(
        embed=lambda m, b: m.wte(b["tokens"]),
        head_loss=lambda m, x, b: jnp.mean(jax.nn.logsumexp(m.head(x), axis=-1)),
    )
    plan = tp_plan.TPPlan({"blocks/*/up": tp_plan.column(), "blocks/*/down": tp_plan.row()})
    batch = {"tokens": np.arange(16, dtype=np.int32).reshape(4, 4) % 12}
    strategy = Parallel(cpu_mesh((4, 2), ("dp", "tp")), plan=plan, sequence_parallel=True)
    with pytest.raises(ValueError, match="block 0 holds batch statistics .*turn sequence_parallel off"):
        strategy.prepare(NormedModel(nnx.Rngs(0)), optax.sgd(0.1), units, batch)


def test_meshes_without_the_strategies_axes_are_clear_errors():
    batch = odd_batches(1)[0]
    with pytest.raises(ValueError, match="mesh axes \\['data'\\] are none of"):
        Parallel(cpu_mesh((8,), ("data",)))
    with pytest.raises(ValueError, match="pass plan=TPPlan"):
        Parallel(cpu_mesh((4, 2), ("dp", "tp")))
    with pytest.raises(ValueError, match="axis 'dp' is not a mesh axis"):
        DDP(cpu_mesh((8,), ("data",)))
    with pytest.raises(ValueError, match="axis 'fsdp' is not a mesh axis"):
        FSDP(cpu_mesh((8,), ("dp",)))
    # named axes work as the defaults do
    run = Parallel(cpu_mesh((8,), ("data",)), dp_axis="data").prepare(
        OddMLP(nnx.Rngs(0)), optax.sgd(0.1), ODD_UNITS, batch
    )
    assert np.isfinite(float(run.step(run.state, batch)[1]["loss"]))


def uneven_masked_batches():
    """Every rank and micro-batch holds real entries (its mean is finite), in different counts: row
    pair r (a rank's rows under dp=8) holds (r mod 6) + 1 of its 6 entries."""
    mask = (np.arange(6)[None, :] <= np.arange(8)[:, None] % 6).astype(np.float32).reshape(16, 3)
    return [{**b, "mask": mask} for b in masked_batches(STEPS)]


def ddp_masked_sum_and_count(model, batch):
    err = (model(batch["x"]) - batch["y"]) ** 2 * batch["mask"]
    return err.sum(), batch["mask"].sum()


@pytest.mark.parametrize(
    "options",
    [dict(dp=8), dict(dp=4, zero1=True, accumulation_steps=2), dict(dp=8, zero1=True, average_in_collective=False)],
    ids=["ddp", "zero1-accumulation", "zero1-sum-in-collective"],
)
def test_ddp_sum_and_count_is_the_global_mean_over_real_entries(options):
    """Ranks (and micro-batches) hold different counts of real entries: with `sum_and_count` the
    loss and the SGD step are the single device's mean over all of them."""

    def make():
        return OddMLP(nnx.Rngs(0), hidden=6)

    data = uneven_masked_batches()
    opt = optax.sgd(0.2, momentum=0.9)
    want = train_single_device(make, masked_loss, data, opt)
    options = dict(options)
    mesh = cpu_mesh((options.pop("dp"),), ("dp",))
    run = DDP(mesh, sum_and_count=True, **options).prepare(make(), opt, ddp_masked_sum_and_count, data[0])
    assert_same_training(train(run, data), want)


def test_ddp_without_sum_and_count_averages_per_rank_means():
    """Why the option exists: each rank's own mean, averaged over ranks, is another loss (the test above
    can fail), and a loss_fn that returns a pair without the option is refused at prepare."""

    def make():
        return OddMLP(nnx.Rngs(0), hidden=6)

    data = uneven_masked_batches()
    want = train_single_device(make, masked_loss, data, optax.sgd(0.2))
    run = DDP(cpu_mesh((8,), ("dp",))).prepare(make(), optax.sgd(0.2), masked_loss, data[0])
    _, m = run.step(run.state, data[0])
    assert abs(float(m["loss"]) - want[0][0]) > 1e-2
    with pytest.raises(ValueError, match="needs loss_fn to return \\(sum, count\\) scalars"):
        DDP(cpu_mesh((8,), ("dp",)), sum_and_count=True).prepare(make(), optax.sgd(0.2), masked_loss, data[0])


SEQPAR_PLAN = tp_plan.TPPlan(
    {"layers/*/up": tp_plan.column(), "layers/*/down": tp_plan.row(), "out": tp_plan.column(gather_output=True)}
)


def test_sequence_parallel_masked_mean_with_scalar_gates_on_the_token_chunks():
    """Under sequence parallelism the blocks' scalar gate and size-1 shift act on each tp rank's chunk
    of the rows (their gradients need a sum over tp), the head gathers the chunks first, and the loss
    is the global mean over real entries (counts differ per data rank)."""
    rng = np.random.default_rng(0)
    data = [
        {
            **b,
            "y": rng.normal(size=(16, 4)).astype(np.float32),
            "mask": np.concatenate([b["mask"], b["mask"][:, :1]], 1),
        }
        for b in masked_batches(STEPS)
    ]

    def make():
        return OddMLP(nnx.Rngs(0), hidden=6, d_out=4, layers=2)

    want = train_single_device(make, masked_loss, data, clipped_momentum())
    units = Units(embed=ODD_UNITS.embed, head_loss=masked_head, blocks="layers", sum_and_count=True)
    strategy = Parallel(
        cpu_mesh((2, 2, 2), ("dp", "fsdp", "tp")), plan=SEQPAR_PLAN, sequence_parallel=True, remat=False
    )
    run = strategy.prepare(make(), clipped_momentum(), units, data[0])
    assert run.sequence_dim == 0
    assert_same_training(train(run, data), want)


@pytest.mark.parametrize(
    ("rules", "match"),
    [
        ({"layers/*/down": tp_plan.row()}, "layers/0/down \\(row parallel\\) gets 6 input features"),
        ({"layers/*/up": tp_plan.row(), "layers/*/down": tp_plan.row()}, "layers/0/up \\(row parallel\\) gets 8"),
        ({"layers/*/up": tp_plan.column(), "layers/*/down": tp_plan.column()}, "layers/0/down \\(column parallel\\)"),
    ],
    ids=["row-without-column", "row-after-row", "column-after-column"],
)
def test_a_plan_whose_layers_do_not_chain_is_a_clear_error(rules, match):
    """A row layer takes one rank's features from a column layer, a column layer whole activations;
    a plan that breaks this must say so, not fail inside the layer's matmul."""
    strategy = Parallel(cpu_mesh((4, 2), ("dp", "tp")), plan=tp_plan.TPPlan(rules))
    with pytest.raises(ValueError, match=match):
        strategy.prepare(OddMLP(nnx.Rngs(0), hidden=6, d=8), optax.sgd(0.1), ODD_UNITS, odd_batches(1)[0])


# -- layers stacked with nnx.vmap, holding scalar and size-1 parameters -------------------------


class StackedOdd(nnx.Module):
    """OddBlock layers stacked with `nnx.vmap` and run with `nnx.scan`: the stacked scalar gate has
    shape (layers,), the shift (layers, 1); neither splits past the layer axis."""

    def __init__(self, rngs: nnx.Rngs, layers=3, d=7, hidden=6):
        self.inp = nnx.Linear(5, d, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return OddBlock(d, hidden, rngs)

        self.layers = make(rngs)
        self.out = nnx.Linear(d, 3, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, layer):
            return layer(x)

        return self.out(forward(self.inp(x), self.layers))


def test_stacked_layers_with_scalar_parameters_under_hsdp_and_tp_match_one_device():
    data = odd_batches(STEPS)
    want = train_single_device(lambda: StackedOdd(nnx.Rngs(0)), odd_loss, data, clipped_momentum())
    units = Units(
        embed=ODD_UNITS.embed,
        head_loss=lambda m, x, b: jnp.mean((m.out(x) - b["y"]) ** 2),
        blocks="layers",
        stacked=True,
    )
    plan = tp_plan.TPPlan({"layers/up": tp_plan.column(), "layers/down": tp_plan.row()})
    run = Parallel(cpu_mesh((2, 2, 2), ("dp", "fsdp", "tp")), plan=plan).prepare(
        StackedOdd(nnx.Rngs(0)), clipped_momentum(), units, data[0]
    )
    assert_same_training(train(run, data), want)


@pytest.mark.parametrize("max_grad_norm", [0.0, -1.0, float("nan")])
def test_a_max_grad_norm_that_is_not_positive_is_refused_by_every_strategy(max_grad_norm):
    """Clipping scales gradients by max_grad_norm / norm: 0 stops training and a negative value
    reverses it without a word. DDP refused it; the engine, FSDP and the pipeline took it."""
    with pytest.raises(ValueError, match="max_grad_norm must be positive or None"):
        DDP(cpu_mesh((8,), ("dp",)), max_grad_norm=max_grad_norm)
    with pytest.raises(ValueError, match="max_grad_norm must be positive or None"):
        Parallel(cpu_mesh((8,), ("fsdp",)), max_grad_norm=max_grad_norm)
    with pytest.raises(ValueError, match="max_grad_norm must be positive or None"):
        FSDP(cpu_mesh((8,), ("fsdp",)), max_grad_norm=max_grad_norm)
    with pytest.raises(ValueError, match="max_grad_norm must be positive or None"):
        Pipelined(cpu_mesh((2, 4), ("pp", "dp")), microbatches=2, max_grad_norm=max_grad_norm)


class ReusesTheLastBlock(OddMLP):
    """The last block applied once more before the head (weight reuse, as universal transformers do)."""

    def __call__(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(self.layers[-1](x)) * self.temperature


def test_embed_or_head_reading_a_blocks_parameters_is_refused_not_computed_with_zeros():
    """The head unit holds only the parameters outside the blocks: reading the last block's there ran it
    on zeros in place of its weights (loss 8.24 where one device has 7.71), silently. DDP trains such a
    model exactly; the engine must refuse it."""
    data = odd_batches(2)
    want = train_single_device(lambda: ReusesTheLastBlock(nnx.Rngs(0)), odd_loss, data, optax.sgd(0.1))
    ddp = DDP(cpu_mesh((8,), ("dp",))).prepare(ReusesTheLastBlock(nnx.Rngs(0)), optax.sgd(0.1), odd_loss, data[0])
    np.testing.assert_allclose(train(ddp, data)[0], want[0], rtol=LOSS_RTOL)

    def head(m, x, b):
        return jnp.mean((m.out(m.layers[-1](x)) * m.temperature - b["y"]) ** 2)

    units = Units(embed=ODD_UNITS.embed, head_loss=head, blocks="layers")
    with pytest.raises(ValueError, match="Units.head_loss reads parameters of the blocks \\(layers/2/"):
        Parallel(cpu_mesh((8,), ("fsdp",))).prepare(ReusesTheLastBlock(nnx.Rngs(0)), optax.sgd(0.1), units, data[0])
    units = Units(embed=lambda m, b: m.layers[0](m.inp(b["x"])), head_loss=ODD_UNITS.head_loss, blocks="layers")
    with pytest.raises(ValueError, match="Units.embed reads parameters of the blocks \\(layers/0/"):
        Pipelined(cpu_mesh((2, 4), ("pp", "dp")), microbatches=2).prepare(
            OddMLP(nnx.Rngs(0), layers=2), optax.sgd(0.1), units, data[0]
        )
