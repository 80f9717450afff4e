"""`TPPlan.from_annotations` on a model annotated for FSDP x TP the way published NNX models are: einsum
attention kernels of three dimensions (heads on tp), norm scales whose axis maps to tp (replicated),
linear MLP and head layers; the derived plan prepares the model as created under its mesh and trains
as on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.reference import train_single_device

from jaxdist.engine.run import Parallel, Units
from jaxdist.tp import plan as tp_plan

D, HEADS, HEAD_DIM, FF, VOCAB, SEQ, BATCH = 16, 4, 4, 32, 32, 8, 8
RULES = [("embed", "fsdp"), ("heads", "tp"), ("mlp", "tp"), ("vocab", "tp"), ("norm", "tp"), ("head_dim", None)]


NORMAL = nnx.initializers.normal(0.3)


def annotated(*names, init=NORMAL):
    return nnx.with_partitioning(init, names)


def norm(n: int, name: str, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(n, scale_init=annotated(name, init=nnx.initializers.ones), rngs=rngs)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        qkv = annotated("embed", "heads", "head_dim")
        self.norm = norm(D, "norm", rngs)  # the tp axis name on a scale: replicated
        self.q, self.k, self.v = (
            nnx.Einsum("BTD,DNH->BTNH", (D, HEADS, HEAD_DIM), kernel_init=qkv, rngs=rngs) for _ in range(3)
        )
        self.q_norm = norm(HEAD_DIM, "head_dim", rngs)
        out = annotated("heads", "head_dim", "embed")
        self.o = nnx.Einsum("BTNH,NHD->BTD", (HEADS, HEAD_DIM, D), kernel_init=out, rngs=rngs)
        self.up = nnx.Linear(D, FF, kernel_init=annotated("embed", "mlp"), rngs=rngs)
        self.down = nnx.Linear(FF, D, kernel_init=annotated("mlp", "embed"), rngs=rngs)

    def __call__(self, x):
        h = self.norm(x)
        q, k, v = self.q_norm(self.q(h)), self.k(h), self.v(h)
        x = x + self.o(jax.nn.dot_product_attention(q, k, v, is_causal=True))
        return x + self.down(jax.nn.gelu(self.up(x)))


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, embedding_init=annotated("vocab", "embed"), rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])
        self.final_norm = norm(D, "norm", rngs)
        self.head = nnx.Linear(D, VOCAB, kernel_init=annotated("embed", "vocab"), rngs=rngs)


def make_model(mesh=None) -> Model:
    if mesh is None:
        with nnx.use_eager_sharding(False):
            return Model(nnx.Rngs(0))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        return Model(nnx.Rngs(0))


def head_loss(model, x, batch):
    logits = model.head(model.final_norm(x)).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()


def model_loss(model, batch):
    x = model.embed(batch["tokens"][:, :-1])
    for block in model.blocks:
        x = block(x)
    return head_loss(model, x, batch)


UNITS = Units(embed=lambda m, b: m.embed(b["tokens"][:, :-1]), head_loss=head_loss, blocks="blocks")


def derived_plan(model) -> tp_plan.TPPlan:
    return tp_plan.TPPlan.from_annotations(model, RULES, overrides={"head": tp_plan.column(gather_output=True)})


def test_annotations_place_einsum_kernels_by_their_equation_and_replicate_norm_scales():
    plan = derived_plan(make_model())
    expected = {
        "embed": tp_plan.vocab(),
        "head": tp_plan.column(gather_output=True),
        **{f"blocks/{i}/{p}": tp_plan.column(dim=-2) for i in range(2) for p in ("q", "k", "v")},
        **{f"blocks/{i}/o": tp_plan.row(dim=-3) for i in range(2)},
        **{f"blocks/{i}/up": tp_plan.column() for i in range(2)},
        **{f"blocks/{i}/down": tp_plan.row() for i in range(2)},
    }
    assert dict(plan.layers) == expected  # no rule for the norms: their scales stay replicated


def test_a_weight_of_an_unknown_equation_annotated_on_tp_names_the_fix():
    class CallTimeEinsum(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(
                nnx.initializers.normal()(rngs.params(), (HEADS, D, HEAD_DIM)),
                out_sharding=("heads", "embed", "head_dim"),
            )

        def __call__(self, eqn, x):
            return jnp.einsum(eqn, x, self.w[...])

    class Holder(nnx.Module):
        def __init__(self, rngs):
            self.q = CallTimeEinsum(rngs)

    with pytest.raises(
        ValueError, match=r"q \(CallTimeEinsum\) maps w axis -3 .*overrides=\{'q': column\(dim=\.\.\., param='w'\)\}"
    ):
        with nnx.use_eager_sharding(False):
            holder = Holder(nnx.Rngs(0))
        tp_plan.TPPlan.from_annotations(holder, RULES)


def batches(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)} for _ in range(n)]


def test_a_model_annotated_for_fsdp_x_tp_prepares_as_it_is_and_trains_as_on_one_device():
    data, sgd = batches(2), optax.sgd(0.5)
    ref_losses, pure, *_ = train_single_device(make_model, model_loss, data, sgd)
    mesh = cpu_mesh((2, 2, 2), ("dp", "fsdp", "tp"))
    model = make_model(mesh)
    run = Parallel(mesh, plan=derived_plan(model)).prepare(model, sgd, UNITS, data[0])
    state, losses = run.state, []
    for batch in data:
        state, metrics = run.step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for have, want in zip(jax.tree.leaves(nnx.to_pure_dict(run.params(state))), jax.tree.leaves(pure), strict=True):
        np.testing.assert_allclose(np.asarray(have), np.asarray(want), rtol=0, atol=1e-5)


def test_a_placement_names_its_dimension_by_the_annotation_or_the_equation():
    modules = list(nnx.iter_graph(make_model()))
    plan = tp_plan.TPPlan(
        {
            "blocks/*/q": tp_plan.column(dim="heads"),  # the kernel's nnx.with_partitioning name
            "blocks/*/k": tp_plan.column(dim="N"),  # its einsum letter
            "blocks/*/o": tp_plan.row(dim=0),
            "blocks/*/v": tp_plan.column(dim="head_dim"),  # an output axis, but not the row's features
        }
    )
    resolved = plan.resolve(modules, 2)
    assert [resolved.layer(("blocks", 0, p)).dim for p in ("q", "k", "o", "v")] == [1, 1, 0, 2]


class EinsumMLP(nnx.Module):
    """Gemma's MLP and attention output as einsums, whose inputs have as many axes as the stacked weights."""

    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Einsum("BTD,DF->BTF", (D, FF), kernel_init=annotated("embed", "mlp"), rngs=rngs)
        self.down = nnx.Einsum("BTF,FD->BTD", (FF, D), kernel_init=annotated("mlp", "embed"), rngs=rngs)
        self.o = nnx.Einsum(
            "BTNH,NHD->BTD", (HEADS, HEAD_DIM, D), kernel_init=annotated("heads", "head_dim", "embed"), rngs=rngs
        )


class StackedEinsums(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def make(rngs):
            return EinsumMLP(rngs)

        self.layers = make(rngs)


def test_stacked_einsum_layers_get_the_placements_of_unstacked_ones():
    """A stacked 'BTD,DF->BTF' has a weight of three axes, as many as its input: the input was taken for
    the weight (up derived row, down and o refused as splitting no placement's axis)."""
    with nnx.use_eager_sharding(False):
        plan = tp_plan.TPPlan.from_annotations(StackedEinsums(nnx.Rngs(0)), RULES)
    assert dict(plan.layers) == {
        "layers/up": tp_plan.column(dim=-1),
        "layers/down": tp_plan.row(dim=-2),
        "layers/o": tp_plan.row(dim=-3),
    }
