"""Under ZeRO-1 the optimizer sees the model's parameter tree, so optax transformations that read
shapes, paths or a global norm train exactly as on one device.

The model is not the GPT: a layer norm and two dense layers whose last bias has 7 elements, which
neither dp=8 nor dp=4 divides, so it stays replicated (all-reduced) while everything else is sharded
(reduce-scattered). Each case trains 3 steps of the same global batches on one device (optax on the
`nnx.State`) and under DDP zero1 over dp=8, over dp=4 of a (4, 2) mesh, and over one device (what
the GPU tests run). Tolerances are tests/support/reference.py's: losses rtol 5e-6, parameters atol 1e-4 per
element and 5e-7 mean (float32 rounding of the mean of per-rank means). Optax applied to flat
bucket shards (the former ZeRO-1) misses by 3e-3 to 0.3 in the loss: a mask or label callable sees
1-D buffers (no kernels, no "bias" paths) and each shard is clipped by its own norm (over one
device the clip case passed before too: one rank's shards are the whole tree).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.reference import LOSS_RTOL, assert_params_close, train_single_device

from jaxdist.ddp.run import DDP

STEPS = 3


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.hidden = nnx.Linear(16, 32, precision="highest", rngs=rngs)
        self.out = nnx.Linear(32, 7, precision="highest", rngs=rngs)  # bias (7,): replicated

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(self.norm(x))))


def net_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def make_batches(scale: float = 1.0) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(16, 16)).astype(np.float32),
            "y": (scale * rng.normal(size=(16, 7))).astype(np.float32),
        }
        for _ in range(STEPS)
    ]


def is_matrix(params):
    return jax.tree.map(lambda x: x.ndim > 1, params)


def by_path(params):
    return jax.tree_util.tree_map_with_path(
        lambda kp, _: "sgd" if "bias" in jax.tree_util.keystr(kp) else "adam", params
    )


# name -> (optimizer factory, target scale: 30 makes the gradient norm far above the clip's 0.1)
OPTIMIZERS = {
    # weight decay on matrices only: optax.masked(add_decayed_weights) with a callable mask
    "masked-adamw": (lambda: optax.adamw(1e-2, weight_decay=0.5, mask=is_matrix), 1.0),
    # the same through optax.masked around the whole adamw, plain sgd on the rest
    "masked-adamw-outer": (
        lambda: optax.chain(
            optax.masked(optax.adamw(1e-2, weight_decay=0.5), is_matrix),
            optax.masked(optax.sgd(0.1), lambda p: jax.tree.map(lambda m: not m, is_matrix(p))),
        ),
        1.0,
    ),
    "multi-transform-by-path": (
        lambda: optax.multi_transform({"sgd": optax.sgd(0.1), "adam": optax.adam(1e-2)}, by_path),
        1.0,
    ),
    "clip-by-global-norm": (lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(0.5)), 30.0),
}
MESHES = {"dp8": ((8,), ("dp",)), "dp4x2": ((4, 2), ("dp", "x")), "dp1": ((1,), ("dp",))}


def unclipped_norm(batches) -> float:
    graphdef, params, rest = nnx.split(Net(nnx.Rngs(0)), nnx.Param, ...)
    grads = jax.jit(jax.grad(lambda p: net_loss(nnx.merge(graphdef, p, rest), batches[0])))(params)  # one compile
    return float(optax.tree.norm(grads))


# dp8 with the slow tests: the fast run splits over two mesh axes (dp4x2) and holds all on one device (dp1)
@pytest.mark.parametrize(
    "mesh_name", [pytest.param(name, marks=pytest.mark.slow if name == "dp8" else ()) for name in MESHES]
)
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_zero1_with_a_tree_optimizer_matches_one_device(opt, mesh_name):
    make_optimizer, scale = OPTIMIZERS[opt]
    batches = make_batches(scale)
    if opt == "clip-by-global-norm":
        assert unclipped_norm(batches) > 10 * 0.1  # the clip binds

    def make_model():
        return Net(nnx.Rngs(0))

    ref_losses, ref_params, *_ = train_single_device(make_model, net_loss, batches, make_optimizer())
    run = DDP(cpu_mesh(*MESHES[mesh_name]), zero1=True, bucket_size=300).prepare(
        make_model(), make_optimizer(), net_loss, batches[0]
    )
    assert len(run.layout) >= 3  # several buckets, the replicated bias in one of its own
    state, losses, norms = run.state, [], []
    for batch in batches:
        state, metrics = run.step(state, batch)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    # the reported norm is the whole gradient's (before any clip), as one device computes it
    _, _, ref_norms, _ = train_single_device(make_model, net_loss, batches, make_optimizer())
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    assert_params_close(run.params(state), ref_params)
    initial = nnx.state(make_model(), nnx.Param)
    moved = [
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(initial), strict=True)
    ]
    assert min(moved) > 1e-3  # every parameter moved, the replicated bias included


def test_zero1_state_is_the_parameter_tree_sharded_per_parameter():
    """Each parameter keeps its shape, split over dp along its first divisible dimension (contiguous
    chunks; the 7-element bias replicated); the optimizer state mirroring it is sharded the same way."""
    mesh = cpu_mesh((8,), ("dp",))
    run = DDP(mesh, zero1=True).prepare(Net(nnx.Rngs(0)), optax.adam(1e-2), net_loss, make_batches()[0])
    params = run.state.params
    assert jax.tree.structure(params) == jax.tree.structure(nnx.state(Net(nnx.Rngs(0)), nnx.Param))

    def local(x):
        return x.addressable_shards[0].data.shape

    assert params["hidden"]["kernel"].shape == (16, 32) and local(params["hidden"]["kernel"]) == (2, 32)
    assert local(params["out"]["kernel"]) == (4, 7)
    assert local(params["norm"]["scale"]) == (2,)
    assert local(params["out"]["bias"]) == (7,)  # no dimension 8 divides: replicated
    mu = run.state.opt_state[0].mu
    for path in (("hidden", "kernel"), ("out", "kernel"), ("out", "bias")):
        p, m = params[path[0]][path[1]], mu[path[0]][path[1]]
        assert m.shape == p.shape and m.sharding.is_equivalent_to(p.sharding, p.ndim)
    kinds = {(b.sharded, b.ranks) for b in run.layout.buckets}
    assert kinds == {(True, 8), (False, 1)}  # rank-major buckets and the replicated bias's own
