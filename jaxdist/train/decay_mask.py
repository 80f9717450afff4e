"""Which parameters get weight decay: GPT recipes decay the weight matrices only.

Norm scales, biases (every one-dimensional parameter) and the positional table are left
undecayed by GPT-2/3-style recipes (nanoGPT, Megatron, torchtitan); decaying them pulls
LayerNorm scales towards zero. The mask is a function of the parameter tree, so it holds under
every strategy: each hands the optimizer the model's parameter tree, not flat buffers.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import jax
import optax

from jaxdist.train.config import ConfigError


def adamw(
    learning_rate, b1: float, b2: float, weight_decay: float, mask: Callable, mu_dtype=None
) -> optax.GradientTransformation:
    """`optax.adamw(..., mask=mask, mu_dtype=mu_dtype)` with the optimizer state of an unmasked `optax.adamw`.

    optax wraps a masked decay's state in a `MaskedState`; keeping the unmasked structure lets
    checkpoints written before the mask existed resume (their leaves are the same: the decay
    has no state)."""
    decay = optax.add_decayed_weights(weight_decay)

    def update(updates, state, params):
        if not weight_decay:
            return updates, state
        decayed, state = decay.update(updates, state, params)
        return jax.tree.map(lambda keep, d, u: d if keep else u, mask(params), decayed, updates), state

    def init(params):
        if weight_decay:
            mask(params)  # a pattern that matches nothing fails here, before the first step
        return decay.init(params)

    masked_decay = optax.GradientTransformation(init, update)
    return optax.chain(
        optax.scale_by_adam(b1=b1, b2=b2, mu_dtype=mu_dtype), masked_decay, optax.scale_by_learning_rate(learning_rate)
    )


def path_name(path) -> str:
    """A parameter's path as the mask patterns see it, e.g. 'blocks/3/attn/qkv/kernel'."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def decay_mask(no_decay: str, decay_vectors: bool) -> Callable:
    """The `mask` argument of `optax.adamw`: True for the parameters that are decayed.

    Args:
      no_decay: comma-separated regular expressions; a parameter whose path matches one (searched
        anywhere in the path) is not decayed. A pattern that matches no parameter is an error,
        so a typo cannot silently decay what it meant to spare.
      decay_vectors: decay one-dimensional parameters (norm scales, biases) too.
    """
    patterns = [p.strip() for p in no_decay.split(",") if p.strip()]
    try:
        compiled = [re.compile(p) for p in patterns]
    except re.error as e:
        raise ConfigError(f"optim.no_decay: {e} in {no_decay!r}; give comma-separated regular expressions") from None

    def mask(params):
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        names = [path_name(path) for path, _ in flat]
        for pattern, regex in zip(patterns, compiled, strict=True):
            if not any(regex.search(n) for n in names):
                raise ConfigError(
                    f"optim.no_decay: {pattern!r} matches no parameter; paths look like {names[0]!r}"
                    f" (all: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''})"
                )

        def decayed(name, x):
            if not decay_vectors and x.ndim <= 1:
                return False
            return not any(regex.search(name) for regex in compiled)

        return treedef.unflatten([decayed(n, x) for n, (_, x) in zip(names, flat, strict=True)])

    return mask
