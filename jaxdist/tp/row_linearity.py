"""A row layer of a type jaxdist does not know (a model's own dense layer) runs its own call on each tp
rank's slice of the input and of its weight, and the ranks' results are summed after it: right only if
the call is linear in its weight. A bias is added once after the sum if it is named `bias` (the call
sees none); a bias of another name, or an activation inside the layer, would be added or applied on
every rank before the sum, silently wrong. `check_row_layer` reads the call's jaxpr at `prepare` and
refuses such a layer, naming what it does to the product. It follows the weight through inner jits,
remat, custom derivatives, conds and loops; zeros (a masked `jnp.where`, a sum started from zero) are
linear; the layer's own methods see the view, so a helper that adds `self.bias` adds none."""

from __future__ import annotations

import inspect
import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend import core as jex_core

from jaxdist.tp.placement import weight_name

# primitives linear in their first operand when no other operand comes from the weight
_LINEAR_IN_FIRST = {
    "neg", "reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims", "convert_element_type",
    "reduce_sum", "slice", "dynamic_slice", "gather", "rev", "copy", "copy_p", "reduce_precision", "cumsum",
    "real", "imag", "conj", "sharding_constraint", "mesh_cast", "pvary", "psum", "all_gather", "pbroadcast",
}  # fmt: skip
_ONE_FACTOR = {"mul", "dot_general", "conv_general_dilated"}  # linear in whichever single operand is the weight's
_SUMS = {"add", "sub", "add_any"}
_ALL_OR_NONE = {"concatenate", "dynamic_update_slice"}
_PASS_THROUGH = {"optimization_barrier"}  # each output is its operand
_SPLITS = {"split", "unstack"}  # several outputs, each linear in the one operand


class WithoutBias:
    """A view of a layer without its bias (a `bias` variable, which the caller adds after the sum), so the
    layer's own code computes the product alone. The layer's methods and properties run on the view too (a
    helper reading `self.bias`)."""

    def __init__(self, module):
        object.__setattr__(self, "_module", module)

    def __getattr__(self, name):
        hidden = isinstance(getattr(self._module, "bias", None), nnx.Variable)
        if name == "bias" and hidden:
            return None
        if name == "use_bias" and hidden:
            return False
        attr = inspect.getattr_static(type(self._module), name, None)
        if isinstance(attr, property):
            return attr.fget(self)
        value = getattr(self._module, name)
        if inspect.ismethod(value) and value.__self__ is self._module:
            return types.MethodType(value.__func__, self)
        return value


def check_row_layer(module, placement, where: str, args: tuple, kwargs: dict, sequence_parallel: bool = False) -> None:
    """Raise if `module`, placed row parallel by `placement` and of a type jaxdist does not know, has a call
    (with these arguments, its bias hidden) that is not linear in its weight, or, under sequence
    parallelism (where each tp rank draws its own random numbers), that masks the product at random."""
    if isinstance(module, (nnx.Linear, nnx.Einsum, nnx.Embed)):  # jaxdist's own row layers add the bias
        return
    param = placement.param or weight_name(module)
    call = type(module).__mro__[1].__call__ if hasattr(module, "_jaxdist_log") else type(module).__call__
    weight = getattr(module, param, None) if param else None
    if not isinstance(weight, nnx.Variable):
        return
    graphdef, state = nnx.split(module)
    cls = call.__qualname__.rsplit(".", 1)[0]

    def copy():  # made inside the trace, new variables: what the call writes (an RNG count) stays off the model
        return nnx.merge(graphdef, jax.tree.map(lambda v: v, state))

    def product(w):
        layer = copy()
        getattr(layer, param).set_value(w)  # the weight's metadata kept (a call may read it)
        return call(WithoutBias(layer), *args, **kwargs)

    try:
        closed = jax.make_jaxpr(product)(weight[...])
    except Exception as without_bias:  # noqa: BLE001 (unless the call runs with its bias: then its own error is the one)
        try:
            jax.eval_shape(lambda: call(copy(), *args, **kwargs))
        except Exception:  # noqa: BLE001
            return
        if isinstance(getattr(module, "bias", None), nnx.Variable):
            raise ValueError(
                f"TPPlan: {where} ({cls}) is row parallel, and its call fails where its `bias` is None: jaxdist runs "
                "the call without the bias on each tp rank's slice and adds the bias once after summing the ranks' "
                "results; let the call skip it (`if self.bias is not None: ...`)"
            ) from without_bias
        raise ValueError(
            f"TPPlan: {where} ({cls}) is row parallel, and jaxdist could not trace its call with {param!r} as an "
            f"input to check that it is linear in it ({type(without_bias).__name__}: {without_bias}); place the "
            "layer otherwise, or use a flax layer (nnx.Linear, nnx.Einsum) for it"
        ) from without_bias
    names = _param_names(module, closed.consts)
    jaxpr = closed.jaxpr
    found = _nonlinear_use(jaxpr, {jaxpr.invars[0]}, names)
    if found is None and not any(_dependent_outputs(jaxpr, [True])):
        found = f"does not compute its output from {param!r} where jaxdist can see it"
    if found is None and sequence_parallel and _random_meets_weight(jaxpr, ["w"])[0]:
        raise ValueError(
            f"TPPlan: {where} ({cls}) is row parallel and applies random numbers (a dropout) to its product; under "
            "sequence parallelism each tp rank draws its own, so the ranks' partial results would be masked "
            "differently before they are summed. Apply the dropout after the layer (its output is then this rank's "
            "tokens), or turn sequence_parallel off (every tp rank then draws the same mask)"
        )
    if found:
        raise ValueError(
            f"TPPlan: {where} ({cls}) is row parallel: each tp rank runs its call on its slice of the input and "
            f"of {param!r}, and the ranks' results are summed after it, so the call must be linear in "
            f"{param!r}; it {found}. Name a bias `bias` (jaxdist adds a parameter of that name once, after the "
            "sum), apply activations outside the layer, or place the layer otherwise"
        )


def _param_names(module, consts) -> dict[int, str]:
    """The module's parameters among the jaxpr's constants, by the constant's id (for the message)."""
    by_id = {}
    for path, var in nnx.iter_graph(module):
        if isinstance(var, nnx.Variable):
            raw = var.get_value() if hasattr(var, "get_value") else var.value  # flax < 0.12: .value
            by_id[id(raw)] = "/".join(map(str, path))
    return {i: by_id[id(c)] for i, c in enumerate(consts) if id(c) in by_id}


def _nonlinear_use(jaxpr, dependent: set, names: dict[int, str], zero_inputs: frozenset = frozenset()) -> str | None:
    """What the jaxpr does to the values in `dependent` (its weight and what is computed from it) that is
    not linear, in words; None if nothing. Values are followed through calls of inner jaxprs."""
    dependent = set(dependent)
    const_index = {v: i for i, v in enumerate(jaxpr.constvars)}
    origin = {}  # a value reshaped, broadcast or cast from a constant: that constant

    def dep(v) -> bool:
        return isinstance(v, jex_core.Var) and v in dependent

    zeros = set(zero_inputs)  # values that are zero everywhere (jnp.zeros, a zero broadcast)

    def zero(v) -> bool:
        if isinstance(v, jex_core.Literal):
            return not np.any(np.asarray(v.val))
        return v in zeros

    def from_weight_or_zero(invars, flags) -> bool:
        return all(f or zero(v) for v, f in zip(invars, flags, strict=True))

    def what(v) -> str:
        if not isinstance(v, jex_core.Var):
            return f"the constant {v.val}"
        name = names.get(const_index.get(origin.get(v, v)))
        return f"the parameter {name!r}" if name else "a value that does not come from the weight"

    for eqn in jaxpr.eqns:
        flags = [dep(v) for v in eqn.invars]
        if not any(flags):
            if eqn.primitive.name in _LINEAR_IN_FIRST and eqn.invars:
                if zero(eqn.invars[0]):
                    zeros.update(eqn.outvars)
                elif isinstance(eqn.invars[0], jex_core.Var):
                    origin[eqn.outvars[0]] = origin.get(eqn.invars[0], eqn.invars[0])
            continue
        prim = eqn.primitive.name
        if prim in ("scan", "while"):
            found, outs = _loop(eqn, flags, zero)
            if found:
                return found
            dependent.update(o for o, d in zip(eqn.outvars, outs, strict=True) if d)
            continue
        if prim == "cond":  # each branch takes the operands after the index
            if flags[0]:
                return "chooses a branch by the product"
            for branch in eqn.params["branches"]:
                inputs = {v for v, f in zip(branch.jaxpr.invars, flags[1:], strict=True) if f}
                found = _nonlinear_use(branch.jaxpr, inputs, {})
                if found:
                    return found
            by_branch = [_dependent_outputs(b.jaxpr, flags[1:]) for b in eqn.params["branches"]]
            outs = [any(o) for o in zip(*by_branch, strict=True)]
            dependent.update(o for o, d in zip(eqn.outvars, outs, strict=True) if d)
            continue
        inner_jaxpr = _inner_jaxpr(eqn)
        if inner_jaxpr is not None:
            pairs = list(zip(inner_jaxpr.invars, flags, eqn.invars, strict=True))
            inner_zeros = frozenset(iv for iv, f, v in pairs if not f and zero(v))
            found = _nonlinear_use(inner_jaxpr, {iv for iv, f, _ in pairs if f}, {}, inner_zeros)
            if found:
                return found
            outs = _dependent_outputs(inner_jaxpr, flags)
            dependent.update(o for o, d in zip(eqn.outvars, outs, strict=True) if d)
            continue
        if prim in _PASS_THROUGH:
            dependent.update(o for o, f in zip(eqn.outvars, flags, strict=True) if f)
            continue
        if prim in _SPLITS and not any(flags[1:]):
            dependent.update(eqn.outvars)
            continue
        to_number = prim != "convert_element_type" or jnp.issubdtype(eqn.params["new_dtype"], jnp.inexact)
        ok = (
            (prim in _LINEAR_IN_FIRST and not any(flags[1:]) and to_number)
            or (prim == "pad" and flags == [True, False] and zero(eqn.invars[1]))
            or (prim in _ONE_FACTOR and sum(flags) == 1)
            or (prim == "div" and flags == [True, False])
            or (prim in _SUMS | _ALL_OR_NONE and from_weight_or_zero(eqn.invars, flags))
            or (prim == "select_n" and not flags[0] and from_weight_or_zero(eqn.invars[1:], flags[1:]))
        )
        if not ok:
            if prim in _SUMS:
                other = next(v for v, f in zip(eqn.invars, flags, strict=True) if not f)
                return f"adds {what(other)} to the product"
            if prim in _ONE_FACTOR:
                return f"multiplies the product by itself ({prim})"
            return f"applies {prim}, which is not linear, to the product"
        dependent.update(eqn.outvars)
    return None


def _loop(eqn, flags: list[bool], zero) -> tuple[str | None, list[bool]]:
    """(what a scan's or while loop's body does that is not linear, or None; which outputs come from the
    weight). A carry the body feeds from the weight comes from it in every iteration (found by iterating
    to a fixed point); such a carry must start from the weight or from zero (a sum)."""
    invars = eqn.invars
    if eqn.primitive.name == "scan":
        body, n_consts, n_carry = eqn.params["jaxpr"].jaxpr, eqn.params["num_consts"], eqn.params["num_carry"]
        cond = None
    else:
        cond, body = eqn.params["cond_jaxpr"].jaxpr, eqn.params["body_jaxpr"].jaxpr
        n_cond, n_consts = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        flags, invars = flags[n_cond:], invars[n_cond:]  # the cond's constants: used by the cond alone
        n_carry = len(eqn.outvars)
    carried = slice(n_consts, n_consts + n_carry)
    f = list(flags)
    for _ in range(n_carry + 1):
        outs = _dependent_outputs(body, f)
        new = f[:n_consts] + [a or b for a, b in zip(f[carried], outs[:n_carry], strict=True)] + f[carried.stop :]
        if new == f:
            break
        f = new
    for v, was, now in zip(invars[carried], flags[carried], f[carried], strict=True):
        if now and not was and not zero(v):
            return "adds to the product a value a loop starts from", []
    if cond is not None and any(_dependent_outputs(cond, [False] * (len(cond.invars) - n_carry) + f[carried])):
        return "decides a loop by the product", []
    found = _nonlinear_use(body, {v for v, d in zip(body.invars, f, strict=True) if d}, {})
    return found, _dependent_outputs(body, f)  # a body's outputs are the loop's (a while's: its carry)


_RANDOM = {"random_bits", "threefry2x32", "rng_uniform", "rng_bit_generator"}  # where random numbers start


def _random_meets_weight(jaxpr, flags: list[str]) -> tuple[bool, list[str]]:
    """(whether an equation applies random numbers to the product, what each output is), given what each
    input is: "w" the weight (or computed from it alone), "p" the product (the weight combined with
    something else), "r" random numbers (or computed from them), "" none of these. Random numbers meeting
    the weight alone (a mask on the weight) or the input (a dropout before the matmul) are not the product's.
    A loop or cond counts as one equation, which draws if any of its jaxprs does."""
    kind = {v: f for v, f in zip(jaxpr.invars, flags, strict=True) if f}
    for eqn in jaxpr.eqns:
        ins = [kind.get(v, "") if isinstance(v, jex_core.Var) else "" for v in eqn.invars]
        inner = _inner_jaxpr(eqn)
        if inner is not None:
            met, outs = _random_meets_weight(inner, ins)
        else:
            draws = eqn.primitive.name in _RANDOM or any(_draws(j) for j in _sub_jaxprs(eqn))
            other = any(isinstance(v, jex_core.Var) and k != "w" for v, k in zip(eqn.invars, ins, strict=True))
            product = "p" in ins or ("w" in ins and other)
            in_loop = next(_sub_jaxprs(eqn), None) is not None  # a loop or cond: the weight may meet its draws inside
            met = ("p" in ins and (draws or "r" in ins)) or ("w" in ins and draws and in_loop)
            out = "p" if product else "w" if "w" in ins else "r" if draws or "r" in ins else ""
            outs = [out] * len(eqn.outvars)
        if met:
            return True, []
        kind.update((o, k) for o, k in zip(eqn.outvars, outs, strict=True) if k)
    return False, [kind.get(v, "") if isinstance(v, jex_core.Var) else "" for v in jaxpr.outvars]


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jex_core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jex_core.Jaxpr):
                yield item


def _draws(jaxpr) -> bool:
    """Whether `jaxpr` (or one inside it) draws random numbers."""
    return any(e.primitive.name in _RANDOM or any(_draws(j) for j in _sub_jaxprs(e)) for e in jaxpr.eqns)


def _inner_jaxpr(eqn):
    """The inner jaxpr of a call-like equation (jit, remat, custom_jvp/vjp) that takes its operands, else None."""
    for value in eqn.params.values():
        if isinstance(value, jex_core.ClosedJaxpr) and len(value.jaxpr.invars) == len(eqn.invars):
            return value.jaxpr
        if isinstance(value, jex_core.Jaxpr) and len(value.invars) == len(eqn.invars):
            return value
    return None


def _dependent_outputs(jaxpr, flags: list[bool]) -> list[bool]:
    """Which outputs of `jaxpr` depend on the inputs flagged."""
    dependent = {v for v, f in zip(jaxpr.invars, flags, strict=True) if f}
    for eqn in jaxpr.eqns:
        if any(isinstance(v, jex_core.Var) and v in dependent for v in eqn.invars):
            dependent.update(eqn.outvars)
    return [isinstance(v, jex_core.Var) and v in dependent for v in jaxpr.outvars]
