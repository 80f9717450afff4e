"""The unit engine's ZeRO-3 (FSDP) on a model other than the GPT whose widths no storage axis divides
(5 in, 7 wide with LayerNorm, 3 out; 4 and 3 devices): its checkpoint is the single-device optax state
and restores onto FSDP over 3 devices and DDP's ZeRO-1 over 3 devices, continuing as the target's own
uninterrupted run (a scale-sensitive chain: global-norm clipping, SGD momentum on a schedule).
Tolerances as tests/support/reference.py: float32 means of per-device means only."""

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
from jaxdist.engine.run import Parallel, Units
from jaxdist.train.checkpoint import Checkpoints

SPLIT, STEPS = 2, 4


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(7, rngs=rngs)
        self.mix = nnx.Linear(7, 7, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.mix(self.norm(x)))


class Residual(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.inp = nnx.Linear(5, 7, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(3)])
        self.out = nnx.Linear(7, 3, rngs=rngs)

    def __call__(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


UNITS = Units(embed=lambda m, b: m.inp(b["x"]), head_loss=lambda m, x, b: jnp.mean((m.out(x) - b["y"]) ** 2))
OPTIMIZER = optax.chain(
    optax.clip_by_global_norm(0.5), optax.sgd(optax.linear_schedule(0.3, 0.03, STEPS), momentum=0.9)
)
_rng = np.random.default_rng(0)
DATA = [
    {"x": _rng.normal(size=(24, 5)).astype(np.float32), "y": _rng.normal(size=(24, 3)).astype(np.float32)}
    for _ in range(STEPS)
]
LAYOUTS = {
    "fsdp4": lambda m: Parallel(cpu_mesh((4,), ("fsdp",))).prepare(m, OPTIMIZER, UNITS, DATA[0]),
    "fsdp3": lambda m: Parallel(cpu_mesh((3,), ("fsdp",))).prepare(m, OPTIMIZER, UNITS, DATA[0]),
    "zero1-3": lambda m: DDP(cpu_mesh((3,), ("dp",)), zero1=True).prepare(m, OPTIMIZER, mse, DATA[0]),
}


def make_model():
    return Residual(nnx.Rngs(0))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    run = LAYOUTS["fsdp4"](make_model())
    state, _ = run_steps(run, DATA[:SPLIT])
    canonical = run.canonical(state)
    _, ref_params, _, ref_opt = train_single_device(make_model, mse, DATA[:SPLIT], OPTIMIZER)
    for a, e in zip(jax.tree.leaves(canonical.params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), atol=1e-5)
    assert jax.tree.structure(canonical.opt_state) == jax.tree.structure(ref_opt)
    for a, e in zip(jax.tree.leaves(canonical.opt_state), jax.tree.leaves(ref_opt), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-4, atol=1e-6)
    ckpt = Checkpoints(tmp_path_factory.mktemp("odd-fsdp"), keep=1)
    ckpt.save(SPLIT, canonical, {})
    ckpt.wait()
    yield ckpt
    ckpt.close()


# zero1-3 is slow: ZeRO-1 over 3 devices restores odd widths in tests/train/test_checkpoint_odd_mlp.py too
# the fast run restores onto fsdp4; fsdp3 (a width it does not divide either) and zero1-3 are slow
@pytest.mark.parametrize(
    "target", ["fsdp4", pytest.param("fsdp3", marks=pytest.mark.slow), pytest.param("zero1-3", marks=pytest.mark.slow)]
)
def test_an_fsdp_checkpoint_of_odd_widths_restores_onto_other_device_counts(saved, target):
    run = LAYOUTS[target](make_model())
    _, whole = run_steps(run, DATA)
    run = LAYOUTS[target](make_model())
    state = run.from_canonical(saved.restore(SPLIT, run.canonical_target()))
    _, rest = run_steps(run, DATA[SPLIT:], state)
    np.testing.assert_allclose(rest, whole[SPLIT:], rtol=1e-5)
    if target == "fsdp4":
        assert rest == whole[SPLIT:]  # same layout: bit-exact
