"""A loss over logits split along the vocabulary: what a head bound with `vocab(loss_parallel=True)`
returns, and the one function that reads it (`cross_entropy`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdist.tp import layers as tp_math

# -- a loss over logits split along the vocabulary ---------------------------------------------
# A head bound with `loss_parallel` returns its logits wrapped: only `cross_entropy` unwraps them,
# and it reduces only per-token scalars over tp. Any other use of the wrapper (an attribute such as
# .ndim, arithmetic, a jnp function, optax's loss, numpy) raises, since one rank's slice of the
# logits read as whole logits would be silently wrong.

_MISUSE = (
    "TP plan: these logits are this rank's vocabulary slice (loss_parallel=True); only "
    "jaxdist.tp.plan.cross_entropy(logits, labels) reads them. Compute the loss with it, or gather "
    "the logits (gather_output=True, or loss_parallel=False on a vocab embedding) to use them otherwise"
)


class VocabShardedLogits:
    """Logits split along the vocabulary over tp, as a loss-parallel head returns them."""

    __slots__ = ("_logits", "_binding")

    def __init__(self, logits: jax.Array, binding):  # binding: the head's jaxdist.tp.bind.Binding
        self._logits, self._binding = logits, binding

    def _refuse(self, *args, **kwargs):
        raise ValueError(_MISUSE)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):  # protocol probes (copy, pickle) find nothing
            raise AttributeError(name)
        raise ValueError(_MISUSE)

    __jax_array__ = __array__ = __array_function__ = __array_ufunc__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __pow__ = __rpow__ = __matmul__ = __rmatmul__ = _refuse
    __getitem__ = __neg__ = __pos__ = __abs__ = __iter__ = __len__ = __bool__ = __float__ = __int__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = _refuse
    __hash__ = object.__hash__

    @property
    def shape(self):
        return self._logits.shape

    @property
    def dtype(self):
        return self._logits.dtype


def _refuse_flatten(logits: VocabShardedLogits):
    raise ValueError(_MISUSE)


# a jitted function (most jnp functions) flattens its arguments before reading them
jax.tree_util.register_pytree_node(VocabShardedLogits, _refuse_flatten, lambda aux, children: None)


def cross_entropy(logits, labels: jax.Array) -> jax.Array:
    """Per-token softmax cross-entropy with integer labels, in float32 (optax's on one device).

    Under a TP plan whose head is `column(loss_parallel=True)` (or `vocab(loss_parallel=True)` for a
    tied `attend`), `logits` are this rank's vocabulary slice and the loss is computed without
    gathering them (`jaxdist.tp.vocab_parallel_cross_entropy`).
    """
    if isinstance(logits, VocabShardedLogits):
        b = logits._binding
        return tp_math.vocab_parallel_cross_entropy(logits._logits, labels, b.axis, backend=b.backend)
    return softmax_cross_entropy(logits, labels)


@jax.custom_vjp
def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """`optax.softmax_cross_entropy_with_integer_labels` of `logits` taken in float32, whose gradient is
    written in the logits' own dtype by one pass over them: autodiff of optax's would write a float32
    gradient of the whole logits ([tokens, vocabulary]: 3.3 GB at GPT-350M, 16 x 1024), subtract the
    labels' one-hot into it by a scatter, and convert it to bfloat16 for the head's matmuls in a third
    pass. A label outside [0, vocabulary) gives a NaN loss, as optax's does."""
    return _cross_entropy_forward(logits, labels)[0]


def _cross_entropy_forward(logits, labels):
    wide = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(wide, axis=-1)
    picked = jnp.take_along_axis(wide, labels[..., None], axis=-1)[..., 0]
    return lse - picked, (logits, labels, lse)


def _cross_entropy_backward(residuals, g):
    logits, labels, lse = residuals
    softmax = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
    one_hot = jnp.arange(logits.shape[-1], dtype=labels.dtype) == labels[..., None]
    dlogits = (softmax - one_hot) * g[..., None].astype(jnp.float32)
    return dlogits.astype(logits.dtype), None


softmax_cross_entropy.defvjp(_cross_entropy_forward, _cross_entropy_backward)
