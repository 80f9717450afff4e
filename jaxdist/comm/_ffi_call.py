"""An XLA FFI call that XLA and JAX keep exactly as written, without a JAX effect.

`jax.ffi.ffi_call(has_side_effect=True)` does two things: it marks the custom
call side-effecting in the HLO, so XLA never removes, merges (CSE), hoists or
rematerializes it (a collective must run exactly where every rank's program
says), and it gives the jaxpr an unordered effect. With an effect, `jit` gives
up its C++ dispatch path and every call of the jitted step goes through Python:
for GPT-350M ZeRO-1 with the nccl backend on 2 x H200 that was 58 ms of host
time per step against 31 ms with XLA's collectives, more than the GPUs' 49 ms.

jaxdist's ops need only the first. Their order is data already (each takes and
returns a token), so `ffi_call` here keeps the HLO side effect and leaves the
jaxpr effect-free. JAX's dead-code elimination, which drops an effect-free
equation whose results are unused, is told to keep these (a dropped `wait`
whose `start` stays would let XLA free buffers NCCL still writes; an op dropped
in one branch of a `cond` on the rank would hang the others): the HLO is the
one `ffi_call(has_side_effect=True)` gives. Unlike with an effect,
`jax.checkpoint` may now recompute them in the backward pass, as it does the
xla backend's `jax.lax` collectives: jaxdist keeps its data-parallel gathers
out of rematerialized regions for both backends (tests/engine/test_engine.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.interpreters import partial_eval as pe

_ffi_call_p = Primitive("jaxdist_ffi_call")
_ffi_call_p.multiple_results = True


class _Attribute:
    """A numpy array attribute, hashable by value (primitive parameters must hash; these are small)."""

    def __init__(self, value: np.ndarray):
        self.value = value
        self._key = (value.dtype.str, value.shape, value.tobytes())

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Attribute) and self._key == other._key

    def __repr__(self):
        return repr(self.value.tolist())


def _abstract_eval(*avals, outs, **_):
    # the results' mesh is the current one, as jax.ffi.ffi_call types them (invariant over manual axes)
    sharding = jax.sharding.NamedSharding(jax.sharding.get_abstract_mesh(), jax.sharding.PartitionSpec())
    return [jax.core.ShapedArray(shape, dtype, sharding=sharding) for shape, dtype in outs]


def _lowering(ctx, *operands, target, outs, aliases, attrs):
    del outs
    rule = jax.ffi.ffi_lowering(target, has_side_effect=True, operand_output_aliases=dict(aliases))
    return rule(ctx, *operands, **{k: v.value if isinstance(v, _Attribute) else v for k, v in attrs})


def _keep(used_outputs, eqn):
    return [True] * len(eqn.invars), eqn  # never dead code: see the module docstring


_ffi_call_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(_ffi_call_p, _lowering)
pe.dce_rules[_ffi_call_p] = _keep


def ffi_call(
    target: str, outs, *args, aliases: dict[int, int] | None = None, **attrs
) -> Sequence[jax.Array] | jax.Array:
    """`jax.ffi.ffi_call(target, outs, has_side_effect=True, input_output_aliases=aliases)(*args, **attrs)`,
    without the jaxpr effect (see the module docstring). `outs`: a ShapeDtypeStruct or a tuple of them."""
    many = isinstance(outs, tuple | list)
    shapes = tuple((tuple(o.shape), np.dtype(o.dtype)) for o in (outs if many else (outs,)))
    hashable = tuple((k, _Attribute(v) if isinstance(v, np.ndarray) else v) for k, v in sorted(attrs.items()))
    results = _ffi_call_p.bind(
        *args, target=target, outs=shapes, aliases=tuple(sorted((aliases or {}).items())), attrs=hashable
    )
    return tuple(results) if many else results[0]
