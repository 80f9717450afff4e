"""The loss DDP differentiates: one micro-batch's loss as a function of the flat parameter leaves.

DDP traces this function's gradient to a jaxpr (the equations its bucket schedule interleaves with
communication) and runs it micro-batch by micro-batch; the model's variables other than parameters
(dropout streams, batch statistics) go in and come out as the stored model state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdist.compat import model_sharding_dropped
from jaxdist.core.model_state import ModelState


class LeafLoss:
    """`loss(leaves, stored, batch) -> (loss, (stored after the forward, count))` of one micro-batch.

    Args:
      graphdef / treedef: the model's graph and its parameters' tree (the leaves' order).
      model_state: how the model's other variables are stored and applied (`jaxdist.core.model_state`).
      loss_fn: the user's `loss_fn(model, batch)`; sum_and_count: whether it returns `(sum, count)`.
      param_avals / stored_avals: ShapeDtypeStructs of the parameter leaves and the stored model state.
      reduce_dtype: the gradients' reduction dtype (None: each parameter's).
    """

    def __init__(
        self,
        graphdef,
        treedef,
        model_state: ModelState,
        loss_fn,
        sum_and_count,
        param_avals,
        stored_avals,
        reduce_dtype,
    ):
        self.graphdef, self.treedef, self.model_state = graphdef, treedef, model_state
        self.loss_fn, self.sum_and_count = loss_fn, sum_and_count
        self.param_avals, self.stored_avals, self.reduce_dtype = param_avals, stored_avals, reduce_dtype

    def __call__(self, leaves, stored, batch):
        """The mean and 1, or with `sum_and_count` the sum and the count `loss_fn` returns."""
        params = self.treedef.unflatten(leaves)
        out, stored = self.model_state.apply(self.graphdef, params, stored, lambda model: self.loss_fn(model, batch))
        if not self.sum_and_count:
            if not (hasattr(out, "shape") and out.shape == ()):
                flag = "; for a (sum, count) pair pass sum_and_count=True" if isinstance(out, tuple) else ""
                shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), out)
                raise ValueError(f"DDP: loss_fn must return a scalar mean loss{flag}, got {shapes}")
            return out, (stored, jnp.ones((), jnp.float32))
        if not (isinstance(out, tuple) and len(out) == 2 and all(jnp.shape(x) == () for x in out)):
            raise ValueError(f"DDP: sum_and_count=True needs loss_fn to return (sum, count) scalars, got {out}")
        total, count = out
        return total, (stored, jnp.asarray(count, jnp.float32))

    def grad_fn(self):
        return jax.value_and_grad(self, has_aux=True)

    @model_sharding_dropped()  # the model's code on one rank's shapes: its own sharding annotations are no-ops
    def grad_jaxpr(self, micro_batch):
        """Inputs: parameter leaves, model state leaves, batch leaves; outputs: loss, model state, count,
        gradients. `micro_batch`: the micro-batch's avals."""
        return jax.make_jaxpr(self.grad_fn())(self.param_avals, self.stored_avals, micro_batch)

    def accumulate(self, leaves, stored, micro):
        """`(loss sum, count sum, gradient sums, model state)` over every micro-batch of `micro` but the
        last (which the caller runs: its gradients are the ones reduced). Gradients are summed in the
        wider of the parameter's and the reduction's dtype (float32 for bfloat16 parameters; a bfloat16
        sum would lose what reducing in float32 keeps)."""
        grad_fn = self.grad_fn()

        def accumulate(carry, mb):
            loss_sum, count_sum, acc, stored = carry
            (loss, (stored, count)), grads = grad_fn(leaves, stored, mb)
            acc = [g + d for g, d in zip(acc, grads, strict=True)]
            # summed in float32 whatever the model computes in (as the step reports the loss)
            return (loss_sum + loss.astype(loss_sum.dtype), count_sum + count, acc, stored), None

        wide = [jnp.promote_types(x.dtype, self.reduce_dtype or x.dtype) for x in self.param_avals]
        zeros = [jnp.zeros(x.shape, dtype) for x, dtype in zip(self.param_avals, wide, strict=True)]
        first = jax.tree.map(lambda x: x[:-1], micro)
        zero = jnp.zeros((), jnp.float32)
        (loss_sum, count_sum, acc, stored), _ = jax.lax.scan(accumulate, (zero, zero, zeros, stored), first)
        return loss_sum, count_sum, acc, stored
