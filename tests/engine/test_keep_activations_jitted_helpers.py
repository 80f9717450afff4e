"""ZeRO-3 keeping activations (`remat=False`) with a block that calls a jitted function on
its weights and activations together. The jit's outputs include a residual of the weights alone
(tanh(w)) next to ones of x; rebuilding it in backward must evaluate only that part of the jit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from support.meshes import cpu_mesh
from support.models import MLP_UNITS, ResMLP, mlp_batches, mlp_loss
from support.reference import LOSS_RTOL, assert_params_close, train_single_device
from support.runs import engine_run

from jaxdist.engine import residuals as _residuals
from jaxdist.engine.run import Parallel


@jax.jit
def _jitted_layer(w, x):
    return x @ jnp.tanh(w)  # tanh(w) and 1 - tanh(w)**2: residuals of w alone, inside the jit


def _fn(w, x, side):
    return jnp.sin(jax.jit(lambda v: _jitted_layer(w["a"], v))(jnp.cos(x))) * side, None


def test_weight_only_values_inside_a_jit_that_also_reads_x():
    w, x, side = {"a": jnp.full((4, 4), 0.3)}, jnp.ones((2, 4)), jnp.full((2, 4), 2.0)
    drop = _residuals.weight_only(_fn, w, x, side)
    assert any(drop)
    leaves = _residuals.residual_leaves(_fn, w, x, side)
    fresh = _residuals.weight_only_values(_fn, w, jax.ShapeDtypeStruct(x.shape, x.dtype), side, drop)
    expected = [leaf for leaf, d in zip(leaves, drop, strict=True) if d]
    assert len(fresh) == len(expected)
    for a, b in zip(fresh, expected, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


class _Block(nnx.Module):
    def __init__(self, d, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (d, d)) * 0.3)

    def __call__(self, x):
        return x + _jitted_layer(self.w[...], x)


def _model(rngs, d=8, layers=2):
    """support/models.py's ResMLP with blocks that call the jitted layer."""
    model = ResMLP(rngs, d=d, layers=0)
    model.layers = nnx.List([_Block(d, rngs) for _ in range(layers)])
    return model


def test_keep_activations_with_a_jitted_helper_in_the_block_matches_single_device():
    data = mlp_batches(2)

    def make():
        return _model(nnx.Rngs(0))

    ref_losses, ref_params, ref_norms, _ = train_single_device(make, mlp_loss, data, optax.sgd(0.5))
    strategy = Parallel(cpu_mesh((8,), ("fsdp",)), remat=False)
    losses, params, _, _, metrics = engine_run(strategy, make, MLP_UNITS, data, optax.sgd(0.5))
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    np.testing.assert_allclose([float(m["grad_norm"]) for m in metrics], ref_norms, rtol=1e-5)
    assert_params_close(params, ref_params, atol=1e-5)
