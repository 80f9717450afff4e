"""The canonical train state: every layout converts to it and back exactly, and it is what a
single-device optax run holds after the same steps (parameters and optimizer state).

Tolerances: parameters as tests/support/reference.py (atol 1e-4 per element; the strategies take means of
per-device means and sum partial products over tp, float32 rounding only); optimizer moments
rtol 1e-3 with atol 1e-6 (first moments, ~gradients) and 1e-9 (second moments, ~gradients squared).
"""

import jax
import numpy as np
import optax
import pytest
from support.layouts import DATA, LAYOUTS, OPTIMIZER, SPLIT, batches, make_model, trained
from support.reference import assert_params_close, train_single_device

from jaxdist.models.gpt import next_token_loss

STEPS = 3
SGD_MOMENTUM = optax.sgd(0.1, momentum=0.9)


def assert_opt_close(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for (kp, a), e in zip(jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected), strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype, kp
        atol = 1e-9 if "nu" in jax.tree_util.keystr(kp) else 1e-6
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-3, atol=atol, err_msg=jax.tree_util.keystr(kp))


# every layout with AdamW; SGD-momentum (scale sensitive: a gradient summed instead of averaged, or a
# moment in bucket order, shows) where the layout reorders; a masked AdamW (weight decay on matrices
# only: masked optimizer states hold empty nodes) on plain DDP, ZeRO-1 and the engine. Marked slow: a
# second layout per optimizer, each a run compiled for this test alone; the fast run keeps AdamW on
# every layout and the masked AdamW under TP (SGD's scale sensitivity is the fast run's in
# tests/engine/test_engine.py's SGD step and grad norm and tests/ddp/test_ddp.py).
CASES = [(layout, "adamw-schedule") for layout in LAYOUTS] + [
    ("zero1-8", "sgd-momentum"),
    ("dp4xtp2", "sgd-momentum"),
    ("ddp8", "masked-adamw"),
    ("zero1-8", "masked-adamw"),
    ("dp4xtp2", "masked-adamw"),
]
SLOW = {("dp4xtp2", "sgd-momentum"), ("ddp8", "masked-adamw"), ("zero1-8", "sgd-momentum"), ("zero1-8", "masked-adamw")}
PARAMS = [pytest.param(*case, id="-".join(case), marks=pytest.mark.slow if case in SLOW else ()) for case in CASES]
OPTIMIZERS = {
    "adamw-schedule": OPTIMIZER,
    "sgd-momentum": SGD_MOMENTUM,
    "masked-adamw": optax.adamw(1e-2, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
}


def data_of(optimizer: str) -> list[dict]:
    # adamw-schedule: the runs of tests/train/test_checkpoint_layouts.py, at their step 3
    return DATA[:SPLIT] if optimizer == "adamw-schedule" else batches(STEPS)


@pytest.fixture(scope="module")
def references():
    """The single-device run of each optimizer, trained once for all the layouts compared with it."""
    made = {}

    def get(optimizer: str):
        if optimizer not in made:
            made[optimizer] = train_single_device(
                make_model, next_token_loss, data_of(optimizer), OPTIMIZERS[optimizer]
            )
        return made[optimizer]

    return get


@pytest.mark.parametrize(("layout", "optimizer"), PARAMS)
def test_canonical_state_is_the_single_device_state_and_round_trips_exactly(
    trained_layouts, references, layout, optimizer
):
    if optimizer == "adamw-schedule":
        trained_layout = trained_layouts(layout)
        run, state, canonical = trained_layout.run, trained_layout.state_at_split, trained_layout.canonical_at_split
    else:
        run, state = trained(layout, OPTIMIZERS[optimizer], data_of(optimizer))
        canonical = run.canonical(state)
    _, ref_params, _, ref_opt = references(optimizer)
    assert_params_close(canonical.params, ref_params)
    assert_opt_close(canonical.opt_state, ref_opt)
    assert int(canonical.step) == STEPS
    # the canonical arrays sit where canonical_shardings says (sharded, not gathered)
    for x, s in zip(jax.tree.leaves(canonical), jax.tree.leaves(run.canonical_shardings()), strict=True):
        assert x.sharding.is_equivalent_to(s, x.ndim)
    back = run.from_canonical(canonical)
    assert jax.tree.structure(back) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_zero1_canonical_state_holds_no_whole_parameter_on_a_device(trained_layouts):
    canonical = trained_layouts("zero1-8").canonical_at_split
    embedding = canonical.params["wte"]["embedding"]
    assert embedding.addressable_shards[0].data.shape == (64 // 8, 32)
    assert canonical.opt_state[0].mu["wte"]["embedding"].addressable_shards[0].data.shape == (8, 32)


def test_from_canonical_refuses_another_model_on_one_line(trained_layouts):
    run = trained_layouts("ddp8").run
    canonical = jax.tree.map(lambda x: x, trained_layouts("ddp8").canonical_at_split)
    canonical.params["wte"]["embedding"] = canonical.params["wte"]["embedding"][:, :16]
    with pytest.raises(ValueError, match=r"from_canonical: \['params'\]|embedding.*expects"):
        run.from_canonical(canonical)
