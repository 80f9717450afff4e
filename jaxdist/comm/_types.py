"""Ordering tokens and async handles: the two values that sequence communication.

A `Token` is a tiny uint8 array (not XLA's token type, which breaks inside
`shard_map` + `scan` on jax 0.10) plus a static chain name. Every op takes a
token and returns a new one; ops threaded through one chain run in chain order.
A `Handle` holds the buffers an async op is communicating; only `wait` turns
it into a usable value, and only inside the `shard_map` that started it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import get_opaque_trace_state

from jaxdist.compat import manual_axes

DEFAULT_CHAIN = "default"
_REBUILT = object()  # the trace of a handle rebuilt from pytree leaves: unknown


@jax.tree_util.register_pytree_node_class
class Token:
    """An ordering token: one uint8 scalar and the name of its chain.

    The chain name is static (part of the pytree structure), so a token keeps
    the same type through `jit`, `scan` and `fori_loop` carries, and `wait`
    can tell a handle's chain from another one.
    """

    __slots__ = ("value", "chain")

    def __init__(self, value: Any, chain: str = DEFAULT_CHAIN):
        self.value = value
        self.chain = chain

    def tree_flatten(self):
        return (self.value,), self.chain

    @classmethod
    def tree_unflatten(cls, chain, children):
        return cls(children[0], chain)

    def __repr__(self) -> str:
        return f"Token(chain={self.chain!r})"


@jax.tree_util.register_pytree_node_class
class Handle:
    """The in-flight state of one async op, returned by a `*_start` function.

    It holds the buffers being communicated (so they stay alive until `wait`)
    and what `wait` needs to finish the op. It has no public accessor for the
    result: `wait(handle, token)` is the only way to get it.
    """

    __slots__ = ("_buffers", "_op", "_chain", "_backend", "_params", "_waited", "_trace", "_manual", "_left")

    def __init__(self, buffers: tuple, op: str, chain: str, backend: str, params: tuple):
        self._buffers = tuple(buffers)
        self._op = op
        self._chain = chain
        self._backend = backend
        self._params = params  # hashable (name, value) pairs the backend needs to finish
        self._waited = False
        self._trace = get_opaque_trace_state(convention="jaxdist")  # where it was started
        self._manual = manual_axes()  # the manual mesh axes of the shard_map it was started in
        self._left = False  # whether it was ever rebuilt outside that shard_map

    def left_its_shard_map(self) -> bool:
        """Whether the handle is outside the shard_map it was started in: returned from it
        (and perhaps passed into another one), or used where the manual axes differ."""
        return self._left or self._manual != manual_axes()

    def crossed_boundary(self) -> bool:
        """Whether the handle left the trace it was started in (a scan/while carry, a jit
        boundary) or was rebuilt from its pytree leaves on the way here."""
        return self._trace is _REBUILT or self._trace != get_opaque_trace_state(convention="jaxdist")

    @property
    def op(self) -> str:
        return self._op

    @property
    def chain(self) -> str:
        return self._chain

    def tree_flatten(self):
        return self._buffers, (self._op, self._chain, self._backend, self._params, self._manual, self._left)

    @classmethod
    def tree_unflatten(cls, aux, children):
        *args, manual, left = aux
        handle = cls(tuple(children), *args)
        handle._trace = _REBUILT
        handle._manual = manual
        # shard_map rebuilds its outputs after leaving its body, where other axes are manual;
        # a scan or jit inside the body rebuilds them where the same axes are. The mark sticks,
        # so a handle passed on into a second shard_map is still known to have left the first.
        handle._left = left or manual != manual_axes()
        return handle

    def __repr__(self) -> str:
        return f"Handle(op={self._op!r}, chain={self._chain!r}, backend={self._backend!r})"


def token(chain: str = DEFAULT_CHAIN) -> Token:
    """Return a fresh ordering token on chain `chain`.

    Sequencing never changes a token's type, so it can be carried through
    `scan`/`fori_loop` and returned from `shard_map` with `out_specs=P()`.
    """
    if not isinstance(chain, str) or not chain:
        raise TypeError(f"token(chain=...) takes a non-empty string, got {chain!r}")
    return Token(jnp.zeros((), jnp.uint8), chain)
