"""The trainer's AdamW decays weight matrices only: not norm scales, biases or the positional table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdist.models.gpt import FLAVORS, GPT
from jaxdist.train import config as config_lib
from jaxdist.train.config import ConfigError
from jaxdist.train.decay_mask import path_name
from jaxdist.train.trainer import make_optimizer


def _params():
    model = GPT(FLAVORS["tiny"], rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    # biases start at 0, which decay leaves in place: make every value nonzero so decay shows
    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(0)
    return treedef.unflatten([jnp.asarray(rng.uniform(0.5, 1.5, x.shape), x.dtype) for x in leaves])


def _optimizer(*overrides):
    cfg = config_lib.load(None, ["optim.warmup_steps=1", "optim.lr=0.1", "optim.weight_decay=0.5", *overrides])
    return make_optimizer(cfg, decay_steps=100)[0]


def _two_steps_without_gradient(optimizer, params):
    """With zero gradients Adam's step is 0, so what moves a parameter is its decay alone:
    step 0 has lr 0 (warmup), step 1 lr 0.1, so a decayed p ends at p * (1 - 0.1 * 0.5)."""
    state = optimizer.init(params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    for _ in range(2):
        updates, state = optimizer.update(zeros, state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
    return params


def _decayed_names(before, after) -> set[str]:
    names = set()
    for (path, b), a in zip(jax.tree_util.tree_flatten_with_path(before)[0], jax.tree.leaves(after), strict=True):
        if not np.allclose(a, b, rtol=0, atol=0):
            np.testing.assert_allclose(a, np.asarray(b) * 0.95, rtol=1e-6, err_msg=path_name(path))
            names.add(path_name(path))
    return names


def test_default_decays_matrices_but_not_norms_biases_or_positions():
    params = _params()
    decayed = _decayed_names(params, _two_steps_without_gradient(_optimizer(), params))
    every = {path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    matrices = {n for n, x in every.items() if x.ndim >= 2 and not n.startswith("wpe")}
    assert decayed == matrices
    assert any(n.startswith("wte") for n in decayed)  # the token embedding is a matrix: decayed
    assert any(n.endswith("ln1/scale") for n in every) and not any("ln" in n for n in decayed)


def test_decay_everything_when_asked():
    params = _params()
    decayed = _decayed_names(
        params, _two_steps_without_gradient(_optimizer("optim.no_decay=", "optim.decay_vectors=true"), params)
    )
    assert decayed == {path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}


def test_patterns_select_by_path():
    params = _params()
    decayed = _decayed_names(params, _two_steps_without_gradient(_optimizer("optim.no_decay=wpe,wte,fc"), params))
    assert decayed and not any(("/fc/" in n or n.startswith(("wte", "wpe"))) for n in decayed)


@pytest.mark.parametrize(
    ("no_decay", "message"),
    [("wpee", "'wpee' matches no parameter; paths look like"), ("ln(", "give comma-separated regular expressions")],
)
def test_a_pattern_that_cannot_apply_is_an_error(no_decay, message):
    with pytest.raises(ConfigError, match=message):
        _optimizer(f"optim.no_decay={no_decay}").init(_params())


def test_same_as_optax_adamw_with_the_mask_and_the_state_of_an_unmasked_one():
    """The state keeps the structure of an unmasked optax.adamw (checkpoints from before the mask
    resume); the updates are optax.adamw's with the mask, on real gradients."""
    import optax

    from jaxdist.train.decay_mask import adamw, decay_mask

    params = _params()
    mask = decay_mask("wpe", False)
    ours, theirs = adamw(0.1, 0.9, 0.95, 0.5, mask), optax.adamw(0.1, 0.9, 0.95, weight_decay=0.5, mask=mask)
    s_ours = ours.init(params)
    assert jax.tree.structure(s_ours) == jax.tree.structure(optax.adamw(0.1, 0.9, 0.95, weight_decay=0.5).init(params))
    s_theirs = theirs.init(params)
    grads = jax.tree.map(lambda p: jnp.sin(3.0 * p), params)
    for _ in range(2):
        u_ours, s_ours = ours.update(grads, s_ours, params)
        u_theirs, s_theirs = theirs.update(grads, s_theirs, params)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), u_ours, u_theirs)


def test_optim_mu_dtype_keeps_the_first_moment_in_bfloat16_as_optax_adamw_does():
    """`optim.mu_dtype=bfloat16`: optax.adamw(mu_dtype=bfloat16)'s updates and state, the second moment
    still float32; the default keeps every moment in the parameters' float32."""
    import optax

    from jaxdist.train.decay_mask import decay_mask

    params = _params()
    ours = _optimizer("optim.mu_dtype=bfloat16")
    schedule = optax.warmup_cosine_decay_schedule(0.0, 0.1, 1, 100, 0.1 * 0.1)
    theirs = optax.adamw(schedule, 0.9, 0.95, weight_decay=0.5, mask=decay_mask("wpe", False), mu_dtype=jnp.bfloat16)
    s_ours, s_theirs = ours.init(params), theirs.init(params)
    grads = jax.tree.map(lambda p: jnp.sin(3.0 * p), params)
    update_ours, update_theirs = jax.jit(ours.update), jax.jit(theirs.update)  # one program each, not op by op
    for _ in range(3):
        u_ours, s_ours = update_ours(grads, s_ours, params)
        u_theirs, s_theirs = update_theirs(grads, s_theirs, params)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), u_ours, u_theirs)
    adam = s_ours[0]
    assert {x.dtype for x in jax.tree.leaves(adam.mu)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(adam.nu)} == {jnp.dtype(jnp.float32)}
    default = _optimizer().init(params)[0]
    assert {x.dtype for x in jax.tree.leaves((default.mu, default.nu))} == {jnp.dtype(jnp.float32)}
