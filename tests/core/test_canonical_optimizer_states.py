"""Adversarial checks of the canonical optimizer state with optimizers whose state does not simply
mirror the parameters: its canonical form must be what a single-device optax run holds (an
independent reference: `support.reference.train_single_device`, plain optax on one device), so a
checkpoint restores onto another layout without a silently reordered statistic.

Adafactor with `min_dim_size_to_factor=8` factors the tiny GPT's matrices: its `v_row`/`v_col`
statistics have the parameter's shape with one dimension removed. Under dp x tp the fused q/k/v
columns are stored in another order (`jaxdist.tp.plan.to_storage`): the column statistic of the
q/k/v kernel must be put back in the model's order too.

Tolerances: tests/core/test_canonical.py's (float32 rounding of means of per-device means only).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support.layouts import LAYOUTS, batches, make_model, trained
from support.reference import assert_params_close, train_single_device

from jaxdist.models.gpt import next_token_loss

ADAFACTOR = optax.adafactor(1e-2, min_dim_size_to_factor=8)
STEPS = 2


def assert_opt_matches(actual, expected):
    """rtol 1e-3, and an absolute tolerance of 1e-4 of each leaf's largest value (float32 rounding of
    near-zero entries); a leaf in another order is off by the order of its values."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for (kp, a), e in zip(jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected), strict=True):
        assert a.shape == e.shape, jax.tree_util.keystr(kp)
        atol = 1e-4 * float(np.abs(np.asarray(e)).max(initial=0.0))
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-3, atol=atol, err_msg=jax.tree_util.keystr(kp))


# SM3 keeps a list of one accumulator per dimension under each parameter's path
SM3 = optax.sm3(1e-2)
CASES = [("dp4xtp2", "adafactor"), ("zero1-8", "adafactor"), ("dp4xtp2", "sm3")]
# the fast run checks both kinds of statistics under TP (the harder reorder); ZeRO-1's flat split is slow
SLOW_CASES = {("zero1-8", "adafactor")}


def qkv_column_statistic(name: str, opt_state):
    """The q/k/v kernel's (96,) statistic over its columns (the kernel is 32 x 96)."""
    if name == "adafactor":
        return opt_state[0].v_col["blocks"][0]["qkv"]["kernel"]
    return opt_state[0].mu["blocks"][0]["qkv"]["kernel"][1]


@pytest.mark.parametrize(
    ("layout", "name"),
    [pytest.param(a, b, id=f"{a}-{b}", marks=pytest.mark.slow if (a, b) in SLOW_CASES else ()) for a, b in CASES],
)
def test_factored_and_per_dimension_statistics_are_canonical_under_tp(layout, name):
    optimizer = {"adafactor": ADAFACTOR, "sm3": SM3}[name]
    data = batches(STEPS)
    _, ref_params, _, ref_opt = train_single_device(make_model, next_token_loss, data, optimizer)
    assert qkv_column_statistic(name, ref_opt).shape == (96,)
    run, state = trained(layout, optimizer, data)
    canonical = run.canonical(state)
    assert_params_close(canonical.params, ref_params)
    assert_opt_matches(canonical.opt_state, ref_opt)
    back = run.from_canonical(canonical)  # and back to the run's own (storage) order, exactly
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def column_second_moments() -> optax.GradientTransformation:
    """A Shampoo-like statistic: each parameter's (columns x columns) gradient products, summed."""

    def init(params):
        return jax.tree.map(lambda p: jnp.zeros((p.shape[-1], p.shape[-1]), p.dtype), params)

    def update(grads, state, params=None):
        def gram(g):
            return g.reshape(-1, g.shape[-1]).T @ g.reshape(-1, g.shape[-1])

        return grads, jax.tree.map(lambda s, g: s + gram(g), state, grads)

    return optax.GradientTransformation(init, update)


def test_a_state_whose_column_order_cannot_be_derived_is_refused_on_one_line():
    """The q/k/v kernel's (96 x 96) statistic would need both dimensions reordered: refused, not saved wrong."""
    data = batches(1)
    optimizer = optax.chain(column_second_moments(), optax.sgd(1e-2))
    run = LAYOUTS["dp4xtp2"](make_model(), optimizer, data[0])
    with pytest.raises(ValueError, match=r"qkv.*canonical order is unknown") as e:
        run.canonical(run.state)
    assert "\n" not in str(e.value)
