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


def check_per_leaf(optimizer: optax.GradientTransformation, params, who: str, sliced=None) -> None:
    """Raise unless `optimizer.update` computes each parameter's update and state from that
    parameter's gradient, value and state (and state no gradient reaches, like a count), element by
    element: the unit engine runs it on each device's shard of a parameter (and on one layer of
    stacked ones), where a norm, a factored mean or a matmul over the whole parameter (LAMB's and
    LARS's trust ratios, Adafactor, clip_by_block_rms, Muon) would see a piece of it.

    Args:
      optimizer: the transformation to check (traced on abstract values, nothing runs).
      params: the parameter tree (arrays or `jax.ShapeDtypeStruct`s).
      who: the caller, for the error message.
      sliced: the same tree with stacked layers' leaves as one layer (the update's shapes there), if any:
        an update whose steps depend on a parameter's shape (a mask by `ndim`) is refused.
    """
    state = jax.eval_shape(optimizer.init, params)
    # a state leaf of another shape than its parameter's (Adafactor's row and column factors) is still its own
    own = [o if o is not None else a for o, a in zip(owners(state, params), owners(state, params, False), strict=True)]
    jaxpr = jax.make_jaxpr(lambda g, s, p: optimizer.update(g, s, p))(params, state, params)
    paths = [kp for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    names = ["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in kp) for kp in paths]
    n = len(jax.tree.leaves(params))
    labels = [{k} for k in range(n)] + [{SHARED if o is None else o} for o in own] + [{k} for k in range(n)]
    deps = _dependencies(jaxpr.jaxpr, labels)
    updates, new_state = deps[:n], deps[n:]
    for k, d in enumerate(updates):
        _refuse_mixing(d - {k, SHARED}, f"the update of {names[k]}", names, who)
    for o, d in zip(own, new_state, strict=True):
        what = "shared optimizer state (e.g. a count)" if o is None else f"the optimizer state of {names[o]}"
        _refuse_mixing(d - ({SHARED} if o is None else {o, SHARED}), what, names, who)
    n_in = len(jaxpr.jaxpr.invars)
    if mixing := _first_mixing_op(jaxpr.jaxpr, [True] * n_in):
        raise ValueError(
            f"{who}: update_in_backward updates each device's shard of a parameter on its own, but the optimizer's "
            f"update is not element by element ({mixing}: a reduction, matmul or random draw over the parameter, as "
            "in lamb, lars, adafactor, clip_by_block_rms, muon or noisy_sgd); use an element-wise optimizer (adam, "
            "adamw, sgd, lion) or update_in_backward=False"
        )
    if sliced is not None:
        piece_state = jax.eval_shape(optimizer.init, sliced)
        piece = jax.make_jaxpr(lambda g, s, p: optimizer.update(g, s, p))(sliced, piece_state, sliced)
        if _steps(piece.jaxpr) != _steps(jaxpr.jaxpr):
            raise ValueError(
                f"{who}: update_in_backward updates stacked layers one layer at a time, but the optimizer's update "
                "takes other steps for one layer than for the stacked parameter (e.g. a mask or label by ndim or "
                "shape); decide by parameter path instead, or update_in_backward=False"
            )


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


# primitives that compute each element of their output from the same element of their inputs
ELEMENTWISE = frozenset(
    """abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type copy copy_p cos
    cosh div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow is_finite le lgamma log log1p
    logistic lt max min mul ne neg nextafter not or pow real reduce_precision rem round rsqrt select_n sign
    sin sinh sqrt square stop_gradient sub tan tanh xor""".split()
)


# primitives that make an array from its shape (positions, random bits): on a shard, not the whole's slice
POSITIONAL = frozenset({"iota", "random_bits", "rng_bit_generator", "rng_uniform"})


def _first_mixing_op(jaxpr, from_leaf: list[bool]) -> str | None:
    """The first equation that mixes elements of an array read from the inputs marked `from_leaf`
    (a reduction, matmul, reshape ...), followed into calls; None if every such step is element-wise.
    A scalar broadcast (a learning rate, a count) mixes nothing."""
    env = dict(zip(jaxpr.invars, from_leaf, strict=True))

    def marked(v):
        return isinstance(v, jcore.Var) and env.get(v, False) and v.aval.shape != ()

    for eqn in jaxpr.eqns:
        ins = [marked(v) for v in eqn.invars]
        inner = [p for p in eqn.params.values() if isinstance(p, (jcore.ClosedJaxpr, jcore.Jaxpr))]
        inner = [p.jaxpr if isinstance(p, jcore.ClosedJaxpr) else p for p in inner]
        name = eqn.primitive.name
        if name in POSITIONAL and any(v.aval.shape != () for v in eqn.outvars):  # per shard: other numbers
            return f"{name} of shape {tuple(eqn.outvars[0].aval.shape)}"
        if len(inner) == 1 and len(inner[0].invars) == len(ins):
            if found := _first_mixing_op(inner[0], ins):
                return found
        elif any(ins) and name not in ELEMENTWISE:
            shapes = ", ".join(str(tuple(v.aval.shape)) for v in eqn.invars if marked(v))
            return f"{name} of {shapes}"
        for v in eqn.outvars:
            env[v] = any(ins)
    return None


def _steps(jaxpr) -> list[str]:
    """The primitives `jaxpr` runs, in order, calls followed (its steps, whatever the shapes)."""
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn.primitive.name)
        for p in eqn.params.values():
            if isinstance(p, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                out += _steps(p.jaxpr if isinstance(p, jcore.ClosedJaxpr) else p)
    return out
