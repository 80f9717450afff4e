"""A column layer of a type jaxdist does not know (a model's own dense layer) runs its own call on the whole
input and each tp rank's slice of its weight, and each rank's output is taken as that rank's slice of the
whole layer's output: right only if each output feature comes from its own columns of the weight alone. A
call that normalizes, softmaxes, sums or reorders across its output features would compute over one rank's
slice of them, silently wrong. `check_column_layer` runs the call at `prepare`, once on the whole weight and
once on each rank's piece (the layer's own weights, random inputs of the traced call's shapes), and refuses
a layer whose pieces are not the slices of its whole output, naming the layer and what to do."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdist.tp import storage

_FLAX_LAYERS = (nnx.Linear, nnx.Einsum, nnx.Embed, nnx.LinearGeneral, nnx.Conv)
_TOLERANCE = 2e-2  # of the output's largest value: bfloat16 noise passes, a wrong slice is of order one


def check_column_layer(where: str, module, layer, size: int, divided: tuple[str, ...], avals) -> None:
    """Raise if the column layer `module` (resolved as `layer`), called with arguments of `avals` (`(args,
    kwargs)` as the trace saw them), gives on a tp rank's pieces other than that rank's slice of its output."""
    if isinstance(module, _FLAX_LAYERS) or layer.kind != "column" or avals is None:
        return  # flax's own layers: each output feature from its own columns
    weight = getattr(module, layer.param, None)
    if not isinstance(weight, nnx.Variable) or tuple(weight.shape) != layer.shape:
        return  # a stacked module's layers (a leading layer axis): not probed
    if any(isinstance(v, nnx.RngState) for _, v in nnx.iter_graph(module)):
        return  # its random draws differ with the shapes drawn for: no slice of one call is another's
    call = type(module).__call__
    graphdef, state = nnx.split(module)
    with jax.ensure_compile_time_eval():
        inputs = _inputs(avals)
        try:
            whole = call(nnx.merge(graphdef, jax.tree.map(lambda v: v, state)), *inputs[0], **inputs[1])
        except Exception:  # noqa: BLE001 (random inputs it cannot take: its real call is not probed)
            return
        if not _is_array(whole) or not jnp.issubdtype(whole.dtype, jnp.inexact) or not np.all(np.isfinite(whole)):
            return
        axis = (layer.equation.out_axis(layer.letter) if layer.equation is not None else -1) % whole.ndim
        groups = layer.placement.groups
        scale = float(jnp.max(jnp.abs(whole.astype(jnp.float32)))) or 1.0
        for rank in range(size):
            piece = nnx.merge(graphdef, jax.tree.map(lambda v: v, state))
            _keep_rank_pieces(piece, layer, rank, size, divided)
            try:
                got = call(piece, *inputs[0], **inputs[1])
            except Exception as e:  # noqa: BLE001 (it runs whole: what fails is the pieces, as in the real run)
                raise ValueError(
                    f"TPPlan: {where} ({type(module).__qualname__}) is column parallel, and its call fails on a tp "
                    f"rank's pieces ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): jaxdist "
                    f"splits its {layer.param!r} and a `bias` along the output features, nothing else, so a second "
                    "per-feature parameter (a gain) or a size read from a static attribute meets one rank's slice. "
                    "Make that part a layer or module of its own, divide the attribute (TPPlan divide=...), or "
                    "place the layer otherwise"
                ) from e
            want = storage.split(whole, axis, groups, rank, size)
            err = float(jnp.max(jnp.abs(jnp.asarray(got, jnp.float32) - jnp.asarray(want, jnp.float32)))) / scale
            if got.shape != want.shape or not err <= _TOLERANCE:
                cls = type(module).__qualname__
                raise ValueError(
                    f"TPPlan: {where} ({cls}) is column parallel: each tp rank runs its call on the whole input and "
                    f"its slice of {layer.param!r}, and takes the result as its slice of the layer's output (axis "
                    f"{axis}); but on tp rank {rank}'s piece its call gives other values than that slice of its call "
                    f"on the whole weight (off by {err:.2g} of the output's largest value), so it computes across "
                    "output features (a norm, softmax, sum or reordering over them). Move that part out of the "
                    "layer (after a row layer, or on an output gathered with gather_output=True), or place the "
                    "layer otherwise"
                )


def _inputs(avals):
    """Arguments of the traced call's shapes: the activations (the first float array) random, other arrays
    (masks, positions) ones, the rest as traced."""
    rng = np.random.default_rng(0)
    args, kwargs = avals
    first = [True]

    def value(a):
        if not isinstance(a, jax.ShapeDtypeStruct):
            return a
        if jnp.issubdtype(a.dtype, jnp.inexact) and first[0]:
            first[0] = False
            return jnp.asarray(rng.normal(size=a.shape), a.dtype)
        return jnp.ones(a.shape, a.dtype)

    return jax.tree.map(value, (args, kwargs))


def _keep_rank_pieces(piece, layer, rank: int, size: int, divided: tuple[str, ...]) -> None:
    """Give the layer copy `piece` tp rank `rank`'s weight and bias and its divided attributes."""
    weight = getattr(piece, layer.param)
    _set(piece, layer.param, storage.split(weight[...], layer.dim, layer.placement.groups, rank, size))
    bias = getattr(piece, "bias", None)
    if isinstance(bias, nnx.Variable) and layer.bias_dim is not None:
        _set(piece, "bias", storage.split(bias[...], layer.bias_dim, layer.placement.groups, rank, size))
    for attr in divided:
        setattr(piece, attr, getattr(piece, attr) // size)


def _set(module, name: str, value) -> None:
    variable = getattr(module, name)
    setattr(module, name, type(variable)(jnp.asarray(value)))


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")
