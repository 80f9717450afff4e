"""A stage's backward split into its input gradient (`B`) and its weight gradient (`W`), as
zero-bubble pipeline schedules run them (Qi et al., 2023, "Zero Bubble Pipeline Parallelism").

The backward `bwd(w, res, dy, side) -> (dw, dx)` is traced once to a jaxpr. B runs the equations
the input gradient `dx` needs; W runs those only the weight gradient `dw` needs, reading the values
of B's equations they use (the gradients at the layers' outputs: `boundary`, kept from B to W), the
residuals `res`, the weights `w` and the side inputs. A value computed from the weights and side
inputs alone (a cast, a transpose, a mask) W computes again rather than keep it. So B and W run
each equation of the backward once, apart from those weight-only ones: W does not replay B.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.extend.core import Var


def _needed(jaxpr, outs) -> set[int]:
    """The equations (indices) the variables `outs` need."""
    want = {v for v in outs if isinstance(v, Var)}
    found = set()
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        if any(v in want for v in eqn.outvars):
            found.add(i)
            want.update(v for v in eqn.invars if isinstance(v, Var))
    return found


class SplitBackward:
    """`bwd` split at its input gradient. Args: `bwd(w, res, dy, side) -> (dw, dx)` and example
    arguments (arrays or ShapeDtypeStructs). `boundary`: the avals of what B passes to W."""

    def __init__(self, bwd: Callable, w, res, dy, side):
        closed, shapes = jax.make_jaxpr(bwd, return_shape=True)(w, res, dy, side)
        self.jaxpr, self.consts = closed.jaxpr, closed.consts
        self.dw_tree, self.dx_tree = jax.tree.structure(shapes[0]), jax.tree.structure(shapes[1])
        jaxpr = self.jaxpr
        self.counts = counts = [len(jax.tree.leaves(a)) for a in (w, res, dy, side)]
        self.n_dx = self.dx_tree.num_leaves
        # which values read the data (the residuals or dy), as opposed to weights and side inputs alone
        flags = [False] * counts[0] + [True] * (counts[1] + counts[2]) + [False] * counts[3]
        data = dict(zip(jaxpr.invars, flags, strict=True))
        for eqn in jaxpr.eqns:
            reads = any(data.get(v, False) for v in eqn.invars if isinstance(v, Var))
            data.update((v, reads) for v in eqn.outvars)
        dw_outs, dx_outs = jaxpr.outvars[: -self.n_dx], jaxpr.outvars[-self.n_dx :]
        for_b, for_w = _needed(jaxpr, dx_outs), _needed(jaxpr, dw_outs)
        # an op with effects (a collective) is never dropped and runs once, in B, with what it reads (a
        # tensor-parallel gradient sum over tp reads a value W alone would otherwise compute)
        effectful = [i for i, eqn in enumerate(jaxpr.eqns) if eqn.effects]
        for_b |= set(effectful) | _needed(jaxpr, [v for i in effectful for v in jaxpr.eqns[i].invars])
        self.b_eqns = sorted(for_b)
        self.w_eqns = sorted(i for i in for_w if i not in for_b or not any(data[v] for v in jaxpr.eqns[i].outvars))
        in_w = {v for i in self.w_eqns for v in jaxpr.eqns[i].outvars}
        res_vars = set(jaxpr.invars[counts[0] : counts[0] + counts[1]])
        reads = [v for i in self.w_eqns for v in jaxpr.eqns[i].invars] + list(dw_outs)
        boundary = []
        for v in reads:
            if isinstance(v, Var) and data.get(v) and v not in in_w and v not in res_vars and v not in boundary:
                boundary.append(v)
        self.boundary_vars = boundary
        self.boundary = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in boundary]

    def _env(self, w, res, dy, side) -> dict:
        """The jaxpr's inputs bound to the arguments (`dy` None: W, which reads it from the boundary)."""
        dys = [None] * self.counts[2] if dy is None else jax.tree.leaves(dy)
        args = [*jax.tree.leaves(w), *jax.tree.leaves(res), *dys, *jax.tree.leaves(side)]
        env = dict(zip(self.jaxpr.constvars, self.consts, strict=True))
        env.update((v, a) for v, a in zip(self.jaxpr.invars, args, strict=True) if a is not None)
        return env

    def _run(self, env: dict, eqns: list[int]) -> None:
        def read(v):
            return env[v] if isinstance(v, Var) else v.val

        for i in eqns:
            eqn = self.jaxpr.eqns[i]
            params = eqn.primitive.get_bind_params(eqn.params)
            subfuns, params = params if isinstance(params, tuple) else ((), params)
            with eqn.ctx.manager:
                out = eqn.primitive.bind(*subfuns, *[read(v) for v in eqn.invars], **params)
            env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out], strict=True))

    def input_gradient(self, w, res, dy, side):
        """B: `(dx, the boundary values W reads)`."""
        env = self._env(w, res, dy, side)
        self._run(env, self.b_eqns)
        dx = [env[v] if isinstance(v, Var) else v.val for v in self.jaxpr.outvars[-self.n_dx :]]
        return self.dx_tree.unflatten(dx), [env[v] for v in self.boundary_vars]

    def weight_gradient(self, w, res, boundary: list, side):
        """W: the weight gradient `dw` from B's `boundary` values."""
        env = self._env(w, res, None, side)
        env.update(zip(self.boundary_vars, boundary, strict=True))
        self._run(env, self.w_eqns)
        dw = [env[v] if isinstance(v, Var) else v.val for v in self.jaxpr.outvars[: -self.n_dx]]
        return self.dw_tree.unflatten(dw)
