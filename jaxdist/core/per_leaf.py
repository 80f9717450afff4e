"""Which optimizer state leaf belongs to which parameter, and whether an optax transformation
updates every parameter on its own (a per-leaf transformation).

An update that runs unit by unit (the unit engine's `update_in_backward`) is exact only for
per-leaf transformations: each parameter's update and state depend on that parameter's
gradient, value and state alone, plus shared state such as a step count that no gradient
touches (adam, adamw, sgd, lion, masks and `multi_transform` by path). A global reduction
(`clip_by_global_norm`, `apply_if_finite`) is not: `check_per_leaf` finds it in the traced
update and raises.
"""

from __future__ import annotations

import jax
import optax
from jax.extend import core as jcore

SHARED = "shared"


def owners(opt_state, params, same_shape: bool = True) -> list[int | None]:
    """For each leaf of `opt_state`, the index of the leaf of `params` it mirrors (same path suffix
    and shape, as Adam's moments do, also inside masked and multi_transform states), or None.
    With `same_shape=False`, the leaf of `params` whose path ends the leaf's path, whatever its shape
    and also where a list index follows it (e.g. Adafactor's row and column statistics of a matrix,
    SM3's list of one accumulator per dimension)."""
    by_path = {
        tuple(str(k) for k in kp): (k, x.shape)
        for k, (kp, x) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0])
    }

    def owner(kp, x):
        if not same_shape:
            while kp and isinstance(kp[-1], jax.tree_util.SequenceKey) and tuple(str(k) for k in kp) not in by_path:
                kp = kp[:-1]
        keys = tuple(str(k) for k in kp)
        for start in range(len(keys)):
            hit = by_path.get(keys[start:])
            if hit is not None and (hit[1] == x.shape or not same_shape):
                return hit[0]
        return None

    return [owner(kp, x) for kp, x in jax.tree_util.tree_flatten_with_path(opt_state)[0]]


def check_per_leaf(optimizer: optax.GradientTransformation, params, who: str) -> None:
    """Raise unless `optimizer.update` computes each parameter's update and state from that
    parameter's gradient, value and state (and state no gradient reaches, like a count).

    Args:
      optimizer: the transformation to check (traced on abstract values, nothing runs).
      params: the parameter tree (arrays or `jax.ShapeDtypeStruct`s).
      who: the caller, for the error message.
    """
    state = jax.eval_shape(optimizer.init, params)
    own = owners(state, params)
    jaxpr = jax.make_jaxpr(lambda g, s, p: optimizer.update(g, s, p))(params, state, params)
    n = len(jax.tree.leaves(params))
    labels = [{k} for k in range(n)] + [{SHARED if o is None else o} for o in own] + [{k} for k in range(n)]
    deps = _dependencies(jaxpr.jaxpr, labels)
    updates, new_state = deps[:n], deps[n:]
    paths = [kp for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    names = ["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in kp) for kp in paths]
    for k, d in enumerate(updates):
        _refuse_mixing(d - {k, SHARED}, f"the update of {names[k]}", names, who)
    for o, d in zip(own, new_state, strict=True):
        what = "shared optimizer state (e.g. a count)" if o is None else f"the optimizer state of {names[o]}"
        _refuse_mixing(d - ({SHARED} if o is None else {o, SHARED}), what, names, who)


def _refuse_mixing(others: set, what: str, names: list[str], who: str) -> None:
    if others:
        read = ", ".join(names[k] for k in sorted(others)[:3]) + (" ..." if len(others) > 3 else "")
        raise ValueError(
            f"{who}: update_in_backward updates each unit on its own, but the optimizer computes {what} from other "
            f"parameters' gradients or state ({read}): a global reduction such as clip_by_global_norm or "
            "apply_if_finite; use a per-leaf optimizer (adam, adamw, sgd, masks) or update_in_backward=False"
        )


def _dependencies(jaxpr, in_labels: list[set]) -> list[set]:
    """The input labels each output of `jaxpr` depends on; calls are followed inside, any other
    equation makes each output depend on all its inputs."""
    env = dict(zip(jaxpr.invars, in_labels, strict=True))

    def read(v):
        return env.get(v, set()) if isinstance(v, jcore.Var) else set()

    for eqn in jaxpr.eqns:
        inner = [p for p in eqn.params.values() if isinstance(p, (jcore.ClosedJaxpr, jcore.Jaxpr))]
        inner = [p.jaxpr if isinstance(p, jcore.ClosedJaxpr) else p for p in inner]
        ins = [read(v) for v in eqn.invars]
        if len(inner) == 1 and len(inner[0].invars) == len(ins) and len(inner[0].outvars) == len(eqn.outvars):
            outs = _dependencies(inner[0], ins)
        else:
            every = set().union(*ins)
            outs = [every] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]
