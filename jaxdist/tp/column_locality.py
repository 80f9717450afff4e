"""A column layer of a type jaxdist does not know (a model's own dense layer, or a flax layer subclass with
its own call) runs its code on the whole input and each tp rank's slice of its weight, and each rank's
output is taken as that rank's slice of the whole layer's output: right only if each output feature comes
from its own columns of the weight alone. A call that normalizes, softmaxes, centres or reorders across its
output features would compute over one rank's slice of them, silently wrong. `check_column_layer` runs the
call at `prepare`, whole and on each rank's pieces (the layer's own weights, random inputs of the traced
call's shapes with a few rows), and refuses a layer whose pieces are not slices of its whole output.

A random probe sees what the inputs it draws reach: code that mixes features only for some values (above
a threshold) can pass it. Layers that draw random numbers are run with their dropouts off; one drawing
them otherwise (a key or `nnx.Rngs` passed in, a stream of its own) is not probed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdist.tp import storage

_FLAX_CALLS = {cls: cls.__call__ for cls in (nnx.Linear, nnx.Einsum, nnx.LinearGeneral, nnx.Conv)}
_ROWS = 2  # of the batch's leading dimension, and at most this many positions of its second
_POSITIONS = 8


def check_column_layer(
    where: str, module, layer, size: int, divided: tuple[str, ...], avals, probed: set | None = None
) -> None:
    """Raise if the column layer `module` (resolved as `layer`), called with arguments of `avals` (`(args,
    kwargs)` as the trace saw them), gives on a tp rank's pieces other than that rank's slice of its output.
    `probed`: the code already run (type, static attributes, placement, arguments), which is not run again."""
    if layer.kind != "column" or avals is None or type(module).__call__ in _FLAX_CALLS.values():
        return  # flax's own layers: each output feature from its own columns
    weight = getattr(module, layer.param, None)
    if not isinstance(weight, nnx.Variable) or tuple(weight.shape) != layer.shape or _draws_otherwise(module, avals):
        return  # a stacked module's layers (a leading layer axis), or random numbers no slice of could match
    call = type(module).__call__
    graphdef, state = nnx.split(module)
    if probed is not None:  # every block's layer runs the same code on other weights: once is enough
        key = (graphdef, layer.placement, layer.shape, divided, repr(avals))
        try:
            if key in probed:
                return
            probed.add(key)
        except TypeError:  # something unhashable: run it
            pass

    def copy():  # new variables (the call may write an RNG count), dropouts off
        out = nnx.merge(graphdef, jax.tree.map(lambda v: v, state))
        for _, sub in nnx.iter_graph(out):
            if isinstance(sub, nnx.Dropout):
                object.__setattr__(sub, "deterministic", True)
        return out

    with jax.ensure_compile_time_eval():
        for inputs in (_inputs(avals, few=True), _inputs(avals, few=False)):
            try:
                whole = call(copy(), *inputs[0], **inputs[1])
                break
            except Exception:  # noqa: BLE001 (the few rows may not fit its code: then the traced shapes)
                continue
        else:
            return  # random inputs it cannot take: not probed
        if not _is_array(whole) or not jnp.issubdtype(whole.dtype, jnp.inexact):
            return
        if not bool(jnp.all(jnp.isfinite(whole))):
            return
        tolerance = 1e-4 if jnp.finfo(whole.dtype).bits >= 32 else 3e-2  # of the output's largest value
        scale = float(jnp.max(jnp.abs(whole.astype(jnp.float32)))) or 1.0
        for rank in range(size):
            piece = copy()
            _keep_rank_pieces(piece, layer, rank, size, divided)
            try:
                got = call(piece, *inputs[0], **inputs[1])
            except Exception as e:  # noqa: BLE001 (it runs whole: what fails is the pieces, as in the real run)
                if isinstance(module, tuple(_FLAX_CALLS)):  # a flax layer subclass: the binding names its cause
                    return
                raise ValueError(
                    f"TPPlan: {where} ({type(module).__qualname__}) is column parallel, and its call fails on a tp "
                    f"rank's pieces ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): jaxdist "
                    f"splits its {layer.param!r} and a `bias` along the output features, nothing else, so a second "
                    "per-feature parameter (a gain) or a size read from a static attribute meets one rank's slice. "
                    "Make that part a layer or module of its own, divide the attribute (TPPlan divide=...), or "
                    "place the layer otherwise"
                ) from e
            err = _off_by(whole, got, rank, size, layer.placement.groups)
            if err is None:
                return  # its output is not split along one axis: the real run says what it makes of that
            if not err <= tolerance * scale:
                raise ValueError(
                    f"TPPlan: {where} ({type(module).__qualname__}) is column parallel: each tp rank runs its call on "
                    f"the whole input and its slice of {layer.param!r}, and takes the result as its slice of the "
                    f"layer's output; but on tp rank {rank}'s piece its call gives other values than that slice of "
                    f"its call on the whole weight (off by {err / scale:.2g} of the output's largest value), so it "
                    "computes across output features (a norm, softmax, centring, sum or reordering over them). Move "
                    "that part out of the layer (after a row layer, or on an output gathered with "
                    "gather_output=True), or place the layer otherwise"
                )


def _off_by(whole, got, rank: int, size: int, groups: int) -> float | None:
    """How far `got` is from rank `rank`'s slice of `whole` along the one axis `size` times shorter in
    `got` (in groups, or contiguous for an output that combines the groups); None if there is no such axis."""
    axes = [
        a
        for a in range(whole.ndim)
        if got.ndim == whole.ndim
        and whole.shape[a] == size * got.shape[a]
        and all(whole.shape[b] == got.shape[b] for b in range(whole.ndim) if b != a)
    ]
    if len(axes) != 1:
        return None
    errs = [
        float(jnp.max(jnp.abs(got.astype(jnp.float32) - _piece(whole, axes[0], g, rank, size).astype(jnp.float32))))
        for g in sorted({groups, 1})
        if whole.shape[axes[0]] % (g * size) == 0
    ]
    return min(errs) if errs else None


def _piece(x, dim: int, groups: int, rank: int, size: int):
    """Rank `rank`'s piece of `x` along `dim`, on its device (`storage.split` without the host copy)."""
    x = storage.to_storage(x, dim, groups, size)
    n = x.shape[dim] // size
    return jax.lax.slice_in_dim(x, rank * n, (rank + 1) * n, axis=dim)


def _draws_otherwise(module, avals) -> bool:
    """Whether the call may draw random numbers other than through its dropouts: a key or `nnx.Rngs`
    among its arguments, or an RNG stream of its own outside an `nnx.Dropout`."""
    leaves = jax.tree.leaves(avals, is_leaf=lambda x: isinstance(x, (nnx.Rngs, nnx.RngStream)))
    if any(isinstance(x, (nnx.Rngs, nnx.RngStream)) for x in leaves):
        return True
    if any(isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key) for x in leaves):
        return True
    dropouts = [p for p, sub in nnx.iter_graph(module) if isinstance(sub, nnx.Dropout)]
    return any(
        isinstance(v, nnx.RngState) and not any(tuple(p[: len(d)]) == tuple(d) for d in dropouts)
        for p, v in nnx.iter_graph(module)
    )


def _inputs(avals, few: bool):
    """Arguments of the traced call's shapes (with `few`, at most _ROWS rows and _POSITIONS positions):
    the activations (the first float array) random and not centred, other arrays (masks, positions) ones,
    the rest as traced."""
    rng = np.random.default_rng(0)
    args, kwargs = avals
    arrays = [a for a in jax.tree.leaves((args, kwargs)) if isinstance(a, jax.ShapeDtypeStruct)]
    lead = arrays[0].shape[:2] if arrays else ()
    first = [True]

    def shape(a):
        if not few:
            return a.shape
        out = list(a.shape)
        if out and lead and out[0] == lead[0]:
            out[0] = min(out[0], _ROWS)
        if len(out) > 2 and len(lead) > 1 and out[1] == lead[1]:
            out[1] = min(out[1], _POSITIONS)
        return tuple(out)

    def value(a):
        if not isinstance(a, jax.ShapeDtypeStruct):
            return a
        if jnp.issubdtype(a.dtype, jnp.inexact) and first[0]:
            first[0] = False
            return jnp.asarray(rng.normal(size=shape(a)) + 0.5, a.dtype)
        return jnp.ones(shape(a), a.dtype)

    return jax.tree.map(value, (args, kwargs))


def _keep_rank_pieces(piece, layer, rank: int, size: int, divided: tuple[str, ...]) -> None:
    """Give the layer copy `piece` tp rank `rank`'s weight and bias and its divided attributes, as the
    binding does (flax's einsum and general layers read their piece's shape)."""
    groups = layer.placement.groups
    weight = getattr(piece, layer.param)
    weight.set_value(_piece(weight[...], layer.dim, groups, rank, size))  # its metadata kept
    bias = getattr(piece, "bias", None)
    if isinstance(bias, nnx.Variable) and layer.bias_dim is not None:
        bias.set_value(_piece(bias[...], layer.bias_dim, groups, rank, size))
    for attr in divided:
        object.__setattr__(piece, attr, getattr(piece, attr) // size)
    if isinstance(piece, nnx.Einsum):
        object.__setattr__(piece, "kernel_shape", tuple(piece.kernel.shape))
    if isinstance(piece, nnx.LinearGeneral):
        shape = tuple(piece.kernel.shape)
        object.__setattr__(piece, "out_features", shape[len(shape) - len(piece.out_features) :])


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")
