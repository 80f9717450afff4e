"""A checkpoint of a model other than the GPT, with sizes no device count divides evenly (5, 7, 6, 3),
restored onto other device counts and layouts with the optimizer state kept.

The optimizer is a chain a single-device recipe would use and that is scale sensitive: global-norm
clipping, weight decay masked to the matrices, SGD with momentum on a linear schedule (its step count
lives in the optimizer state and must survive). References, all independent of the code under test:
plain optax on one device for the canonical state at the split, and an uninterrupted run on the
target layout for the continuation. Tolerances as tests/support/reference.py (float32 means of per-device
means only): losses rtol 1e-5, parameters atol 1e-5.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.meshes import cpu_mesh
from support.reference import train_single_device
from support.runs import run_steps

from jaxdist.ddp.run import DDP
from jaxdist.train.checkpoint import Checkpoints

SPLIT, STEPS, BATCH = 2, 4, 48


class OddMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.a = nnx.Linear(5, 7, rngs=rngs)
        self.b = nnx.Linear(7, 6, rngs=rngs)
        self.c = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
        return self.c(jnp.tanh(self.b(jnp.tanh(self.a(x)))))


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def make_optimizer():
    def matrices(p):
        return jax.tree.map(lambda x: x.ndim > 1, p)

    return optax.chain(
        optax.clip_by_global_norm(0.5),
        optax.add_decayed_weights(1e-2, mask=matrices),
        optax.sgd(optax.linear_schedule(0.3, 0.03, STEPS), momentum=0.9),
    )


def data():
    rng = np.random.default_rng(7)
    return [
        {"x": rng.normal(size=(BATCH, 5)).astype(np.float32), "y": rng.normal(size=(BATCH, 3)).astype(np.float32)}
        for _ in range(STEPS)
    ]


LAYOUTS = {
    "zero1-8": lambda: DDP(cpu_mesh((8,), ("dp",)), zero1=True),
    "zero1-3": lambda: DDP(cpu_mesh((3,), ("dp",)), zero1=True),
    "ddp2-accumulate2": lambda: DDP(cpu_mesh((2,), ("dp",)), zero1=False, accumulation_steps=2),
    "zero1-6-accumulate2": lambda: DDP(cpu_mesh((6,), ("dp",)), zero1=True, accumulation_steps=2),
    "one": lambda: DDP(cpu_mesh((1,), ("dp",))),
}


def prepared(layout: str):
    return LAYOUTS[layout]().prepare(OddMLP(nnx.Rngs(0)), make_optimizer(), mse, data()[0])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Step SPLIT of the ZeRO-1 run over 8 devices (no dimension divides 8: all replicated)."""
    run = prepared("zero1-8")
    state, _ = run_steps(run, data()[:SPLIT])
    ckpt = Checkpoints(tmp_path_factory.mktemp("odd"), keep=1)
    ckpt.save(SPLIT, run.canonical(state), {})
    ckpt.wait()
    yield ckpt
    ckpt.close()


def test_the_saved_state_is_the_single_device_optax_state(saved):
    run = prepared("one")
    restored = saved.restore(SPLIT, run.canonical_target())
    _, params, _, opt_state = train_single_device(lambda: OddMLP(nnx.Rngs(0)), mse, data()[:SPLIT], make_optimizer())
    assert int(restored.step) == SPLIT
    assert jax.tree.structure(restored.opt_state) == jax.tree.structure(opt_state)
    for a, e in zip(jax.tree.leaves(restored.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), atol=1e-5)
    for (kp, a), e in zip(
        jax.tree_util.tree_flatten_with_path(restored.opt_state)[0], jax.tree.leaves(opt_state), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(kp))


@pytest.mark.parametrize("target", ["zero1-3", "ddp2-accumulate2", "zero1-6-accumulate2", "one", "zero1-8"])
def test_restore_onto_other_device_counts_continues_the_targets_uninterrupted_run(saved, target):
    run = prepared(target)
    _, whole = run_steps(run, data())
    run = prepared(target)
    state = run.from_canonical(saved.restore(SPLIT, run.canonical_target()))
    if target == "zero1-3":  # the 6-wide layers split over 3 devices here (replicated in the source)
        assert state.params["b"]["kernel"].addressable_shards[0].data.shape == (7, 2)
    assert int(state.step) == SPLIT
    state, rest = run_steps(run, data()[SPLIT:], state)
    np.testing.assert_allclose(rest, whole[SPLIT:], rtol=1e-5)
    if target == "zero1-8":
        assert rest == whole[SPLIT:]  # the source layout's own run: bit-exact
