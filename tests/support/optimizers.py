"""The optax chains the strategy tests share: each is one the strategies must reproduce exactly."""

import jax
import optax


def adamw():
    return optax.adamw(1e-3, weight_decay=0.1)


def clipped_momentum(max_norm: float = 0.05):
    """Scale-sensitive: a gradient off by any factor moves the parameters off (an active clip, then SGD)."""
    return optax.chain(optax.clip_by_global_norm(max_norm), optax.sgd(0.2, momentum=0.9))


def _kernels(params):
    return jax.tree_util.tree_map_with_path(lambda path, _: "kernel" in str(path[-1]), params)


def _sgd_for_blocks(params):
    return jax.tree_util.tree_map_with_path(lambda path, _: "sgd" if "layers" in str(path) else "adam", params)


def path_optimizer(max_norm: float):
    """Global-norm clipping, then SGD for the blocks and AdamW with weight decay on kernels only."""
    adam = optax.chain(
        optax.scale_by_adam(), optax.masked(optax.add_decayed_weights(0.1), _kernels), optax.scale(-1e-2)
    )
    return optax.chain(
        optax.clip_by_global_norm(max_norm),
        optax.multi_transform({"sgd": optax.sgd(0.1), "adam": adam}, _sgd_for_blocks),
    )
