"""The one-device cross-entropy (`jaxdist.tp.plan.cross_entropy` on whole logits) against float64 math: its
value and gradient are optax's to float32 rounding, its gradient comes out in the logits' dtype (bfloat16
logits: the same bfloat16 values as autodiff of optax's rounds to), and a label outside the vocabulary
gives a NaN loss, as optax's does."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxdist.tp.plan import cross_entropy


def _inputs(dtype):
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, 5, 97)) * 4, dtype)
    labels = jnp.asarray(rng.integers(0, 97, (3, 5)), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)  # a per-token cotangent that is not uniform
    return logits, labels, weights


def _float64_reference(logits, labels, weights):
    x = np.asarray(logits, np.float64)
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    loss = lse - np.take_along_axis(x, np.asarray(labels)[..., None], -1)[..., 0]
    softmax = np.exp(x - lse[..., None])
    grad = (softmax - np.eye(x.shape[-1])[np.asarray(labels)]) * np.asarray(weights, np.float64)[..., None]
    return (loss * np.asarray(weights, np.float64)).sum(), grad


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_value_and_gradient_match_float64_math_and_optax(dtype):
    logits, labels, weights = _inputs(dtype)
    value, grad = jax.value_and_grad(lambda x: jnp.sum(cross_entropy(x, labels) * weights))(logits)
    ref_value, ref_grad = _float64_reference(logits, labels, weights)
    assert grad.dtype == logits.dtype
    np.testing.assert_allclose(float(value), ref_value, rtol=1e-6)
    atol = 1e-6 if dtype == jnp.float32 else 2**-8 * np.abs(ref_grad).max()  # a bfloat16 rounding
    np.testing.assert_allclose(np.asarray(grad, np.float64), ref_grad, atol=atol)

    def optax_loss(x):
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), labels) * weights)

    optax_grad = jax.grad(optax_loss)(logits)
    if dtype == jnp.bfloat16:  # both round the same float32 gradient to bfloat16
        np.testing.assert_array_equal(np.asarray(grad, np.float32), np.asarray(optax_grad, np.float32))


def test_a_label_outside_the_vocabulary_gives_nan_as_optax_does():
    logits = jnp.zeros((2, 4))
    labels = jnp.array([1, 7])
    ours = np.asarray(cross_entropy(logits, labels))
    theirs = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
    np.testing.assert_allclose(ours[0], np.log(4.0), rtol=1e-6)
    assert np.isnan(ours[1]) and np.isnan(theirs[1])
