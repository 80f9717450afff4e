"""The single-device reference every parity test compares a strategy with, and the comparisons.

`train_single_device` is plain training on one device: the unmodified model, one `jax.value_and_grad`
over the whole global batch, the same optax transformation on the pure parameter dict, float32 unless
the model says otherwise. A strategy takes means of per-device means and sums partial products over
tp, so it differs from this by float32 rounding only.

Tolerances (float32): losses agree to 5e-6 relative. Adam divides each gradient by its own running RMS,
so on the few coordinates whose gradient is itself near rounding level that noise is not scaled down:
one step can move them by a sizeable fraction of lr. Parameters therefore get two checks: every element
within 1e-4 (10% of lr=1e-3; observed maxima 1.2e-5 for DDP, 3.7e-5 for an embedding row of a rare
token under tensor parallelism), and the mean difference within 5e-7. A real bug (sum instead of mean,
a bucket left out, stale parameters, a skipped update) moves most coordinates by about lr per step and
fails both by orders of magnitude.
"""

from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from flax import nnx

LOSS_RTOL, PARAM_ATOL, PARAM_MEAN_ATOL = 5e-6, 1e-4, 5e-7


class Reference(NamedTuple):
    losses: list[float]
    params: dict  # the pure parameter dict (`nnx.to_pure_dict`) after the last step
    grad_norms: list[float]  # the global norm of each step's gradient, before the optimizer
    opt_state: Any  # the optimizer's state after the last step


def train_single_device(make_model, loss_fn, batches, optimizer) -> Reference:
    """Train `make_model()` with `optimizer` on one device, one step per batch of `batches`."""
    graphdef, params, rest = nnx.split(make_model(), nnx.Param, ...)
    pure = nnx.to_pure_dict(params)
    opt_state = optimizer.init(pure)
    # the other variables rebuilt inside the trace: a forward that updates them (statistics) may
    rest_leaves, rest_def = jax.tree.flatten(rest)

    def model_of(p):
        return nnx.merge(graphdef, p, jax.tree.unflatten(rest_def, rest_leaves))

    @jax.jit
    def step(p, s, batch):
        loss, g = jax.value_and_grad(lambda p: loss_fn(model_of(p), batch))(p)
        updates, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, updates), s, loss, optax.global_norm(g)

    device = jax.local_devices(backend="cpu")[0]  # this process's (several processes each run the reference)
    pure, opt_state = jax.device_put((pure, opt_state), device)
    losses, norms = [], []
    for batch in batches:
        pure, opt_state, loss, norm = step(pure, opt_state, jax.device_put(batch, device))
        losses.append(float(loss))
        norms.append(float(norm))
    return Reference(losses, pure, norms, opt_state)


def assert_params_close(actual, expected, atol=PARAM_ATOL):
    """Every element within `atol`, and the mean difference within PARAM_MEAN_ATOL."""
    a, e = jax.tree.leaves(actual), jax.tree.leaves(expected)
    assert len(a) == len(e)
    for x, y in zip(a, e, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)
    diffs = np.concatenate([np.abs(np.asarray(x) - np.asarray(y)).ravel() for x, y in zip(a, e, strict=True)])
    assert diffs.mean() < PARAM_MEAN_ATOL, diffs.mean()


def assert_same_training(got, want, atol=2e-5, check_norms=True):
    """`got` against `want`, both `(losses, pure params, grad norms, ...)` (a `Reference`, or what
    `support.runs.train` returns), the parameters leaf by leaf by path."""
    losses, params, norms = got[:3]
    want_losses, want_params, want_norms = want[:3]
    np.testing.assert_allclose(losses, want_losses, rtol=LOSS_RTOL)
    if check_norms:
        np.testing.assert_allclose(norms, want_norms, rtol=1e-5)
    flat = jax.tree_util.tree_leaves_with_path(params)
    ref_flat = dict(jax.tree_util.tree_leaves_with_path(want_params))
    assert len(flat) == len(ref_flat)
    for path, x in flat:
        np.testing.assert_allclose(
            np.asarray(x), np.asarray(ref_flat[path]), rtol=1e-5, atol=atol, err_msg=jax.tree_util.keystr(path)
        )
