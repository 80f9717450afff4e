"""Tensor parallelism over layers written as published Flax NNX models write them, against one device.

The model: an `nnx.Embed` subclass that scales its lookup by sqrt(d_model) (Gemma's) and ties its
`attend` as the head; one block of `nnx.Einsum` attention (q/k/v `'BTD,DNH->BTNH'`, out
`'BTNH,NHD->BTD'`, a biased q, q/k RMSNorm over head_dim, fewer kv heads than q heads); one block of
Gemma-style attention, a custom einsum layer whose weight is `w` and whose equation is its call's
first argument (q `'BTD,NDH->BTNH'`, a fused kv `'BSD,CKDH->CBSKH'`, out `'BTNH,NHD->BTD'`); and
an MLP of `nnx.Linear` subclasses with their own `__call__` (a constant after the product, which a
row layer must add once, not once per tp rank). The plan names no dimension: each placement splits
what its layer's type implies (heads). SGD with momentum against a single-device optax run on the
model's own code: losses, gradient norms, parameters, and the canonical state's round trip.
"""

import warnings

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

D, HEADS, KV_HEADS, HEAD_DIM, FF, VOCAB, SEQ, BATCH = 16, 8, 4, 4, 32, 32, 8, 8
STEPS = 3


class ScaledEmbed(nnx.Embed):
    """Gemma's embedding: the lookup times sqrt(d_model); the tied head reads a scaled query."""

    def __call__(self, tokens):
        return super().__call__(tokens) * jnp.sqrt(float(self.features))

    def attend(self, query):
        return super().attend(query * 0.5)


class Shifted(nnx.Linear):
    """A linear layer whose own call adds a constant after the product."""

    def __call__(self, x):
        return super().__call__(x) + 0.25


class EinsumAttention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, qk_norm: bool = True):
        init = nnx.initializers.normal(0.3)
        kv = (D, KV_HEADS, HEAD_DIM)
        self.q = nnx.Einsum("BTD,DNH->BTNH", (D, HEADS, HEAD_DIM), (HEADS, HEAD_DIM), kernel_init=init, rngs=rngs)
        self.q.bias[...] = jax.random.normal(jax.random.key(1), (HEADS, HEAD_DIM)) * 0.1  # a bias with a layout
        self.k = nnx.Einsum("BTD,DNH->BTNH", kv, kernel_init=init, rngs=rngs)
        self.v = nnx.Einsum("BTD,DNH->BTNH", kv, kernel_init=init, rngs=rngs)
        self.o = nnx.Einsum("BTNH,NHD->BTD", (HEADS, HEAD_DIM, D), (D,), kernel_init=init, rngs=rngs)
        self.q_norm = nnx.RMSNorm(HEAD_DIM, rngs=rngs) if qk_norm else None
        self.k_norm = nnx.RMSNorm(HEAD_DIM, rngs=rngs) if qk_norm else None

    def __call__(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o(attention(q, k, v))


class Einsum(nnx.Module):
    """The Gemma port's einsum layer: weight `w`, the equation given at each call."""

    def __init__(self, shape: tuple, *, rngs: nnx.Rngs):
        self.w = nnx.Param(nnx.initializers.normal(0.3)(rngs.params(), shape))

    def __call__(self, eqn: str, x):
        return jnp.einsum(eqn, x, self.w[...])


class GemmaAttention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.q_einsum = Einsum((HEADS, D, HEAD_DIM), rngs=rngs)
        self.kv_einsum = Einsum((2, KV_HEADS, D, HEAD_DIM), rngs=rngs)
        self.attn_vec_einsum = Einsum((HEADS, HEAD_DIM, D), rngs=rngs)

    def __call__(self, x):
        q = self.q_einsum("BTD,NDH->BTNH", x)
        k, v = self.kv_einsum("BSD,CKDH->CBSKH", x)
        return self.attn_vec_einsum("BTNH,NHD->BTD", attention(q, k, v))


def attention(q, k, v):
    """Causal attention of q heads over fewer k/v heads, sizes from the arrays (one rank's heads too)."""
    k, v = (jnp.repeat(a, q.shape[2] // a.shape[2], axis=2) for a in (k, v))
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, gemma: bool, qk_norm: bool = True):
        self.norm1 = nnx.RMSNorm(D, rngs=rngs)
        self.attn = GemmaAttention(rngs) if gemma else EinsumAttention(rngs, qk_norm)
        self.norm2 = nnx.RMSNorm(D, rngs=rngs)
        self.up = Shifted(D, FF, rngs=rngs)
        self.down = Shifted(FF, D, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, qk_norm: bool = True):
        self.embed = ScaledEmbed(VOCAB, D, embedding_init=nnx.initializers.normal(0.3), rngs=rngs)
        self.blocks = nnx.List([Block(rngs, gemma=False, qk_norm=qk_norm), Block(rngs, gemma=True)])
        self.final_norm = nnx.RMSNorm(D, rngs=rngs)

    def logits(self, x):
        return self.embed.attend(self.final_norm(x))


def embed(model, batch):
    return model.embed(batch["tokens"][:, :-1])


def head_loss(model, x, batch):
    return tp_plan.cross_entropy(model.logits(x), batch["tokens"][:, 1:]).mean()


def model_loss(model, batch):
    x = embed(model, batch)
    for block in model.blocks:
        x = block(x)
    return head_loss(model, x, batch)


UNITS = Units(embed=embed, head_loss=head_loss, blocks="blocks")
PLAN = tp_plan.TPPlan(
    {
        "embed": tp_plan.vocab(loss_parallel=True),
        "blocks/*/attn/q": tp_plan.column(),
        "blocks/*/attn/k": tp_plan.column(),
        "blocks/*/attn/v": tp_plan.column(),
        "blocks/*/attn/o": tp_plan.row(),
        "blocks/*/attn/q_einsum": tp_plan.column(),
        "blocks/*/attn/kv_einsum": tp_plan.column(),
        "blocks/*/attn/attn_vec_einsum": tp_plan.row(),
        "blocks/*/up": tp_plan.column(),
        "blocks/*/down": tp_plan.row(),
    }
)
OPTIMIZER = optax.sgd(0.5, momentum=0.9)


def batches(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)} for _ in range(n)]


def single_device(make, data):
    """The model's own loss over the whole batch, optax on its parameter dict: losses, norms, params."""
    losses, params, norms, _ = train_single_device(make, model_loss, data, OPTIMIZER)
    return losses, norms, params


def assert_trees_close(actual, expected, atol):
    flat = jax.tree_util.tree_flatten_with_path(expected)[0]
    got = jax.tree.leaves(actual)
    assert len(got) == len(flat)
    for (path, want), have in zip(flat, got, strict=True):
        np.testing.assert_allclose(np.asarray(have), np.asarray(want), rtol=0, atol=atol, err_msg=str(path))


@pytest.fixture(scope="module")
def reference():
    return single_device(lambda: Model(nnx.Rngs(0)), batches(STEPS))


# tp=4 with the slow tests; the fast run splits the heads over tp=2
@pytest.mark.parametrize(
    "shape", [pytest.param((4, 2), id="dp4xtp2"), pytest.param((2, 4), id="dp2xtp4", marks=pytest.mark.slow)]
)
def test_einsum_layers_split_by_heads_train_as_on_one_device(reference, shape):
    ref_losses, ref_norms, ref_params = reference
    run = Parallel(cpu_mesh(shape, ("dp", "tp")), plan=PLAN).prepare(
        Model(nnx.Rngs(0)), OPTIMIZER, UNITS, batches(1)[0]
    )
    # each default split is the heads: the layer type's, from its equation (the Gemma layers' at call time)
    tp = shape[1]
    local = {
        ("blocks", 0, "attn", "q", "kernel"): (D, HEADS // tp, HEAD_DIM),
        ("blocks", 0, "attn", "q", "bias"): (HEADS // tp, HEAD_DIM),
        ("blocks", 0, "attn", "k", "kernel"): (D, KV_HEADS // tp, HEAD_DIM),
        ("blocks", 0, "attn", "o", "kernel"): (HEADS // tp, HEAD_DIM, D),
        ("blocks", 1, "attn", "q_einsum", "w"): (HEADS // tp, D, HEAD_DIM),
        ("blocks", 1, "attn", "kv_einsum", "w"): (2, KV_HEADS // tp, D, HEAD_DIM),
        ("blocks", 1, "attn", "attn_vec_einsum", "w"): (HEADS // tp, HEAD_DIM, D),
    }
    by_path = {leaf.path: leaf.local for leaf in run.leaves}
    assert {p: by_path[p] for p in local} == local
    state, losses, norms = run.state, [], []
    for batch in batches(STEPS):
        state, metrics = run.step(state, batch)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    np.testing.assert_allclose(losses[0], ref_losses[0], rtol=2e-6)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    assert_trees_close(nnx.to_pure_dict(run.params(state)), ref_params, atol=1e-5)
    # the canonical state is the single device's, and converts back to this layout
    canonical = run.canonical(state)
    assert_trees_close(canonical.params, ref_params, atol=1e-5)
    again = run.from_canonical(canonical)
    assert_trees_close(nnx.to_pure_dict(run.params(again)), ref_params, atol=1e-5)


def test_the_test_can_fail_a_scale_left_out_or_added_per_rank_changes_the_loss(reference):
    """Without the embedding's scale, or with the row layer's constant added once per rank, the
    first loss moves well beyond the tolerance above."""
    data = batches(1)
    plain = Model(nnx.Rngs(0))
    plain.embed.__class__ = nnx.Embed  # the lookup alone, without the subclass's scale
    per_rank = Model(nnx.Rngs(0))
    for block in per_rank.blocks:
        block.down.__class__ = ShiftedTwice  # tp=2 ranks each adding the row layer's constant
    for model in (plain, per_rank):
        graphdef, state = nnx.split(model)
        loss = jax.jit(lambda s, b, g=graphdef: model_loss(nnx.merge(g, s), b))(state, data[0])
        assert abs(float(loss) - reference[0][0]) > 1e-3


class ShiftedTwice(nnx.Linear):
    def __call__(self, x):
        return super().__call__(x) + 0.5


def test_a_column_splitting_head_dim_before_a_row_splitting_heads_raises_at_prepare():
    """q/k/v split along head_dim while the output layer splits heads: each rank would read another
    rank's features (or a norm over head_dim would fail on its own reshape); prepare names both layers."""
    plan = tp_plan.TPPlan(
        {
            **PLAN.layers,
            "blocks/*/attn/q": tp_plan.column(dim=-1),
            "blocks/*/attn/k": tp_plan.column(dim="H"),
            "blocks/*/attn/v": tp_plan.column(dim=2),
        }
    )
    for qk_norm in (True, False):
        with pytest.raises(
            ValueError, match=r"column layer blocks/0/attn/q .*dim 2 \(H\).*row layer blocks/0/attn/o\b.*dim 0 \(N\)"
        ):
            Parallel(cpu_mesh((4, 2), ("dp", "tp")), plan=plan).prepare(
                Model(nnx.Rngs(0), qk_norm=qk_norm), OPTIMIZER, UNITS, batches(1)[0]
            )


def test_a_placement_naming_a_contracted_axis_or_no_weight_raises():
    mesh = cpu_mesh((4, 2), ("dp", "tp"))
    cases = [
        (
            {"blocks/*/attn/q": tp_plan.column(dim="D")},
            r"attn/q: column\(dim='D'\) .*not among the output",
        ),
        ({"blocks/*/attn/o": tp_plan.row(dim=-1)}, r"blocks/0/attn/o: row\(dim=-1\) .*not among the contracted"),
        ({"blocks/*/attn/q_einsum": tp_plan.column(param="kernel")}, r"q_einsum is column parallel but has no"),
        ({"blocks/*/attn/o": tp_plan.row(dim="heads")}, r"row\(dim='heads'\) names no axis"),
    ]
    for change, match in cases:
        with pytest.raises(ValueError, match=match):
            Parallel(mesh, plan=tp_plan.TPPlan({**PLAN.layers, **change})).prepare(
                Model(nnx.Rngs(0)), OPTIMIZER, UNITS, batches(1)[0]
            )


class Bypass(nnx.Linear):
    """A subclass computing its product itself: no split computation of the base class runs."""

    def __call__(self, x):
        return x @ self.kernel[...] + self.bias[...]


def test_a_placed_subclass_that_never_calls_its_base_computation_raises_at_prepare():
    model = Model(nnx.Rngs(0))
    model.blocks[0].up.__class__ = Bypass
    with pytest.raises(ValueError, match=r"blocks/0/up \(Bypass\) overrides __call__ without calling nnx.Linear"):
        Parallel(cpu_mesh((4, 2), ("dp", "tp")), plan=PLAN).prepare(model, OPTIMIZER, UNITS, batches(1)[0])


def test_default_splits_follow_each_layer_type_on_kernels_of_any_rank():
    """Heads, whatever the kernel's rank: nnx.LinearGeneral's first output / contracted axis, a fused
    q/k/v einsum's heads (not its stacked axis of 3); an unknown 3-D weight asks for its dimension."""

    class Layers(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.q = nnx.LinearGeneral(D, (HEADS, HEAD_DIM), rngs=rngs)
            self.o = nnx.LinearGeneral((HEADS, HEAD_DIM), D, axis=(-2, -1), rngs=rngs)
            self.qkv = nnx.Einsum("BTD,SNDH->SBTNH", (3, HEADS, D, HEAD_DIM), rngs=rngs)
            self.out = nnx.Einsum("BTNH,NHD->BTD", (HEADS, HEAD_DIM, D), rngs=rngs)
            self.fixed = Einsum((D, HEADS, HEAD_DIM), rngs=rngs)  # its equation comes only with a call

    modules = list(nnx.iter_graph(Layers(nnx.Rngs(0))))
    plan = tp_plan.TPPlan({"q": tp_plan.column(), "o": tp_plan.row(), "qkv": tp_plan.column(), "out": tp_plan.row()})
    resolved = plan.resolve(modules, 2)
    dims = {path: (layer.param, layer.dim) for path, layer in resolved.layers.items()}
    assert dims == {("q",): ("kernel", 1), ("o",): ("kernel", 0), ("qkv",): ("kernel", 1), ("out",): ("kernel", 0)}
    assert resolved.param_split(("q", "bias"), 2) == (0, 1)  # the bias (heads, head_dim) along heads
    with pytest.raises(ValueError, match=r"fixed: cannot tell which axis of w \(16, 8, 4\).*column\(dim=\.\.\.\)"):
        tp_plan.TPPlan({"fixed": tp_plan.column()}).resolve(modules, 2)


def test_a_row_einsum_fed_whole_heads_raises_naming_the_layer():
    """The output projection placed without its q/k/v columns reads all heads where its piece takes
    one rank's: the feature check covers 3-D kernels (the contracted heads and head_dim)."""
    plan = tp_plan.TPPlan({k: v for k, v in PLAN.layers.items() if k.split("/")[-1] not in ("q", "k", "v")})
    with pytest.raises(
        ValueError,
        match=r"blocks/0/attn/o \(row parallel\) gets \(8, 4\) input features where its kernel piece takes \(4, 4\)",
    ):
        Parallel(cpu_mesh((4, 2), ("dp", "tp")), plan=plan).prepare(Model(nnx.Rngs(0)), OPTIMIZER, UNITS, batches(1)[0])


class FusedQKV(nnx.Module):
    """MaxText's fused_qkv: one LinearGeneral to (3, heads, head_dim), indexed before attention."""

    def __init__(self, rngs: nnx.Rngs):
        self.qkv = nnx.LinearGeneral(D, (3, HEADS, HEAD_DIM), rngs=rngs)
        self.o = nnx.LinearGeneral((HEADS, HEAD_DIM), D, axis=(-2, -1), rngs=rngs)

    def __call__(self, x):
        qkv = self.qkv(x)
        return x + self.o(jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True))


class FusedModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.wte = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([FusedQKV(rngs) for _ in range(2)])
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)


def fused_head_loss(model, x, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model.head(x), batch["tokens"][:, 1:]).mean()


def fused_loss(model, batch):
    x = model.wte(batch["tokens"][:, :-1])
    for block in model.blocks:
        x = block(x)
    return fused_head_loss(model, x, batch)


def test_a_fused_qkv_linear_general_split_by_heads_is_accepted_and_trains_as_on_one_device():
    """Its output keeps the 3 apart from the heads, which the model indexes away: heads split on both sides
    line up, though in the flattened (3, heads, head_dim) each rank's heads are 3 interleaved blocks
    (the chain check refused it)."""
    rng = np.random.default_rng(0)
    data = [{"tokens": rng.integers(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)} for _ in range(2)]
    ref = train_single_device(lambda: FusedModel(nnx.Rngs(0)), fused_loss, data, optax.sgd(0.5))
    plan = tp_plan.TPPlan({"blocks/*/qkv": tp_plan.column(dim=2), "blocks/*/o": tp_plan.row(dim=0)})
    units = Units(embed=lambda m, b: m.wte(b["tokens"][:, :-1]), head_loss=fused_head_loss)
    run = Parallel(cpu_mesh((4, 2), ("dp", "tp")), plan=plan).prepare(
        FusedModel(nnx.Rngs(0)), optax.sgd(0.5), units, data[0]
    )
    state, losses, norms = run.state, [], []
    for batch in data:
        state, metrics = run.step(state, batch)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    np.testing.assert_allclose(losses, ref.losses, rtol=1e-5)
    np.testing.assert_allclose(norms, ref.grad_norms, rtol=1e-5)
    for got, want in zip(
        jax.tree.leaves(nnx.to_pure_dict(run.params(state))), jax.tree.leaves(ref.params), strict=True
    ):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)


class NormedMLP(nnx.Module):
    """NormFormer's norm inside the MLP, over the up projection's features (a column layer's output)."""

    def __init__(self, rngs: nnx.Rngs, use_scale: bool):
        self.up = nnx.Linear(D, FF, rngs=rngs)
        self.norm = nnx.LayerNorm(FF, use_scale=use_scale, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(FF, D, rngs=rngs)

    def __call__(self, x):
        return x + self.down(self.norm(jax.nn.gelu(self.up(x))))


class NormedModel(FusedModel):
    def __init__(self, rngs: nnx.Rngs, use_scale: bool):
        super().__init__(rngs)
        self.blocks = nnx.List([NormedMLP(rngs, use_scale) for _ in range(2)])


@pytest.mark.parametrize("use_scale", [False, True])
def test_a_norm_over_a_column_layers_split_features_raises_naming_it(use_scale):
    """Without a scale each rank normalized its half of the features alone and trained on (first loss
    4.5597 against one device's 4.6214); with one, flax failed on a reshape naming no layer."""
    plan = tp_plan.TPPlan({"blocks/*/up": tp_plan.column(), "blocks/*/down": tp_plan.row()})
    units = Units(embed=lambda m, b: m.wte(b["tokens"][:, :-1]), head_loss=fused_head_loss)
    batch = {"tokens": np.zeros((BATCH, SEQ + 1), np.int32)}
    with pytest.raises(ValueError, match=r"blocks/0/norm \(LayerNorm\) normalizes 32 features but gets 16 \(tp=2\)"):
        Parallel(cpu_mesh((4, 2), ("dp", "tp")), plan=plan).prepare(
            NormedModel(nnx.Rngs(0), use_scale), optax.sgd(0.1), units, batch
        )


class CountedAttention(nnx.Module):
    """Attention that groups its features into heads by a count it holds, as most published code does."""

    def __init__(self, rngs: nnx.Rngs):
        self.n_heads, self.head_dim = HEADS, HEAD_DIM  # head_dim is a width: never divided, never warned of
        self.qkv = nnx.Linear(D, 3 * HEADS * HEAD_DIM, rngs=rngs)
        self.o = nnx.Linear(HEADS * HEAD_DIM, D, rngs=rngs)

    def __call__(self, x):
        q, k, v = (a.reshape(*a.shape[:-1], self.n_heads, -1) for a in jnp.split(self.qkv(x), 3, axis=-1))
        return x + self.o(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(*x.shape[:-1], -1))


class CountedModel(FusedModel):
    def __init__(self, rngs: nnx.Rngs):
        super().__init__(rngs)
        self.blocks = nnx.List([CountedAttention(rngs) for _ in range(2)])


def plan_warnings(plan: tp_plan.TPPlan) -> list[str]:
    """The TPPlan warnings of preparing CountedModel under `plan` on dp2 x tp2."""
    units = Units(embed=lambda m, b: m.wte(b["tokens"][:, :-1]), head_loss=fused_head_loss)
    batch = {"tokens": np.zeros((BATCH, SEQ + 1), np.int32)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Parallel(cpu_mesh((4, 2), ("dp", "tp")), plan=plan).prepare(
            CountedModel(nnx.Rngs(0)), optax.sgd(0.1), units, batch
        )
    return [str(w.message) for w in caught if "TPPlan:" in str(w.message)]


@pytest.mark.parametrize("divide", [{}, {"blocks/*": ("n_heads",)}], ids=["undivided", "divided"])
def test_a_head_count_the_plan_does_not_divide_is_warned_of_once(divide):
    """Without the divide each rank grouped its features into n_heads heads half as wide and trained on
    (second loss 4.1588 against one device's 3.9982)."""
    said = plan_warnings(
        tp_plan.TPPlan({"blocks/*/qkv": tp_plan.column(groups=3), "blocks/*/o": tp_plan.row()}, divide)
    )
    if divide:
        assert said == []
    else:
        assert len(said) == 1 and said[0].startswith("TPPlan: blocks/*.n_heads=8 counts heads"), said
        assert "add divide={'blocks/*': ('n_heads',)}" in said[0]


def test_a_fused_projection_split_without_its_groups_is_warned_of_once():
    """q, k and v one after another in one kernel, split contiguously: each rank held q and half of k and
    trained on. Parts interleaved per head (GPT-NeoX) split contiguously are right, so this only warns."""
    said = plan_warnings(
        tp_plan.TPPlan({"blocks/*/qkv": tp_plan.column(), "blocks/*/o": tp_plan.row()}, {"blocks/*": ("n_heads",)})
    )
    assert len(said) == 1 and said[0].startswith("TPPlan: column layer blocks/*/qkv makes 3x the features"), said
    assert "column(groups=3)" in said[0]


class PlaceholderNormMLP(NormedMLP):
    """A parameter-free norm whose num_features is a placeholder, over whole features: no TP error."""

    def __init__(self, rngs: nnx.Rngs):
        super().__init__(rngs, use_scale=False)
        self.pre = nnx.LayerNorm(1, use_scale=False, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.pre(x))))


def test_a_parameter_free_norm_with_a_placeholder_width_over_whole_features_is_accepted():
    model = FusedModel(nnx.Rngs(0))
    model.blocks = nnx.List([PlaceholderNormMLP(nnx.Rngs(i)) for i in range(2)])
    plan = tp_plan.TPPlan({"blocks/*/up": tp_plan.column(), "blocks/*/down": tp_plan.row()})
    units = Units(embed=lambda m, b: m.wte(b["tokens"][:, :-1]), head_loss=fused_head_loss)
    batch = {"tokens": np.zeros((BATCH, SEQ + 1), np.int32)}
    run = Parallel(cpu_mesh((4, 2), ("dp", "tp")), plan=plan).prepare(model, optax.sgd(0.1), units, batch)
    assert np.isfinite(float(run.step(run.state, batch)[1]["loss"]))
