"""The model split into units: the outer model (embed and head) and each block, with their own
code (graphdefs), parameter tree structures and non-parameter variables (`ModelState`s), and the
TP plan resolved on them.

`ModelSplit` is what the rest of the engine reads about the model; `jaxdist.engine.apply` runs
the units' code on parameter pieces.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdist.compat import model_sharding_dropped
from jaxdist.core.model_state import ModelState, split_params
from jaxdist.engine.options import Options, Units
from jaxdist.tp.call_log import CallLog
from jaxdist.tp.plan import ResolvedPlan


def same_definition(a: nnx.GraphDef, b: nnx.GraphDef) -> bool:
    """Whether two blocks' definitions (code and static attributes) are equal. Compared, never hashed:
    a block may hold an unhashable attribute (a plain dataclass config); an attribute whose comparison
    fails (an array's) counts as different."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def definition_kinds(defs: list[nnx.GraphDef]) -> list[int]:
    """For each definition, the index of the first one equal to it: blocks of one kind run one program
    (traced once); the index, not the definition, keys what is traced per kind."""
    firsts: list[int] = []
    kinds = []
    for i, d in enumerate(defs):
        kind = next((j for j in firsts if same_definition(defs[j], d)), None)
        if kind is None:
            firsts.append(i)
            kind = i
        kinds.append(kind)
    return kinds


STACKED_CONSTANT_BYTES = 64 * 2**20  # compiled into the program: beyond this, compiling slows and memory doubles


def _check_stacked_constants(rest, where: str) -> None:
    """Refuse stacked layers whose non-parameter variables are too large to compile in as constants."""
    size = sum(getattr(a, "nbytes", 0) for a in jax.tree.leaves(rest))
    if size > STACKED_CONSTANT_BYTES:
        raise ValueError(
            f"Parallel: the stacked layers at {where!r} hold {size / 2**20:.0f} MiB of non-parameter variables "
            f"(frozen weights, tables), compiled into the step as constants up to {STACKED_CONSTANT_BYTES >> 20} MiB; "
            "pass the blocks as a list (Units(stacked=False)), whose variables travel in the train state, or keep "
            "frozen weights as nnx.Param and freeze them in the optimizer (optax.set_to_zero)"
        )


def _off_mesh(a):
    """A replicated array's value on the host (a program closes over it as a constant of no mesh)."""
    if not isinstance(a, jax.Array):
        return a
    if not (a.is_fully_addressable or a.sharding.is_fully_replicated):
        raise ValueError(
            f"Parallel: stacked layers hold a non-parameter variable of shape {a.shape} split across processes; "
            "keep such variables replicated, or pass the blocks as a list (Units(stacked=False))"
        )
    return np.asarray(a if a.is_fully_addressable else a.addressable_data(0))


def layer_of(tree, i: int):
    """Layer `i` of a stacked module's tree (every leaf's slice along the layer axis)."""
    return jax.tree.map(lambda a: a[i], tree)


def abstract(tree):
    """`tree`'s arrays as ShapeDtypeStructs."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def call_block(i: int, block, x, batch, call):
    """Block `i` run as `Units.block_call` says (default `block(x)`); an output of another shape than
    the activations raises, naming the fix."""
    y = call(block, x, batch) if call is not None else block(x)
    if getattr(y, "shape", None) != x.shape:
        shape = getattr(y, "shape", type(y).__name__)
        raise ValueError(
            f"Parallel: block {i} returned {shape} for activations of shape {x.shape}; pass "
            "Units(block_call=...) returning the activations, e.g. `lambda blk, x, b: blk(x, b['pos'])[1]`"
        )
    return y


class ModelSplit:
    """A model (a training copy, its variables on auto axes) split as `units` says.

    Attributes:
      graphdef, template, pure, rest: the model's definition, its parameters (an `nnx.State` and the
        pure dict) and its other variables.
      n_blocks: how many blocks; block_defs, block_kinds, block_rests, block_trees: each block's
        definition, kind (`definition_kinds`), non-parameter variables and parameter tree structure
        (a stacked module's layers share its single-layer definition).
      outer_state, block_states: the `ModelState`s of the outer model's variables and each block's
        (None for stacked layers, whose variables are constants); initial_model_state: what the
        train state stores, `{"outer": ..., "blocks": {i: ...}}`.
    """

    def __init__(self, model: nnx.Module, units: Units, who: str):
        self.units = units
        self._split_blocks(model, units)
        self.graphdef, params, self.rest = split_params(model, who)
        self._split_model_state(self.rest, units)
        self.template = params
        self.pure = nnx.to_pure_dict(params)

    def _split_blocks(self, model, units: Units) -> None:
        blocks = getattr(model, units.blocks, None)
        if units.stacked:
            if not isinstance(blocks, nnx.Module) or hasattr(blocks, "__len__"):
                raise ValueError(
                    f"Parallel: Units(stacked=True) needs one module with stacked layers at attribute "
                    f"{units.blocks!r}, got {type(blocks).__name__}; pass stacked=False for a list of blocks"
                )
            g, p, r = nnx.split(blocks, nnx.Param, ...)
            leads = {x.shape[0] if x.ndim else None for x in jax.tree.leaves(p)}
            if len(leads) != 1 or None in leads:
                raise ValueError(
                    f"Parallel: the stacked layers at {units.blocks!r} must hold every parameter with one "
                    f"leading layer axis; found leading sizes {sorted(leads, key=str)}"
                )
            self.n_blocks = leads.pop()
            self.block_defs = [g] * self.n_blocks
            self.block_kinds = [0] * self.n_blocks
            _check_stacked_constants(r, units.blocks)
            # each layer's constants (a frozen weight, a table), read by the per-device program as constants:
            # off the model's mesh, whose sharding a program inside shard_map may not close over
            self.block_rests = [layer_of(jax.tree.map(_off_mesh, r), i) for i in range(self.n_blocks)]
            self.block_trees = [jax.tree.structure(nnx.to_pure_dict(p))] * self.n_blocks
            self.first_layer = nnx.merge(g, layer_of(nnx.to_pure_dict(p), 0), self.block_rests[0])
            return
        if blocks is None or not hasattr(blocks, "__len__"):
            hint = (
                "; for layers stacked with nnx.vmap pass Units(stacked=True)" if isinstance(blocks, nnx.Module) else ""
            )
            raise ValueError(f"Parallel: the model has no list of blocks at attribute {units.blocks!r}{hint}")
        self.n_blocks = len(blocks)
        self.block_defs, self.block_rests, self.block_trees = [], [], []
        for i in range(self.n_blocks):
            g, p, r = nnx.split(blocks[i], nnx.Param, ...)
            self.block_defs.append(g)
            self.block_rests.append(r)
            self.block_trees.append(jax.tree.structure(nnx.to_pure_dict(p)))
        self.block_kinds = definition_kinds(self.block_defs)

    def _split_model_state(self, rest, units: Units) -> None:
        """The non-parameter variables (RNG streams, batch statistics, constants): the outer model's,
        and each block's own, as `jaxdist.core.model_state.ModelState`s stored in the train state."""
        in_model = rest.get(units.blocks, nnx.State({}))
        outer_rest = nnx.State({k: v for k, v in rest.items() if k != units.blocks})
        self.outer_state = ModelState(outer_rest)
        self.blocks_fixed = {units.blocks: in_model} if units.blocks in rest else {}  # completes the outer model
        if units.stacked:  # layers keep their slices of the stacked module's constants
            kinds = {type(v).__name__ for _, v in in_model.flat_state()}
            mutable = sorted(k for k in kinds if k in ("RngCount", "RngKey", "BatchStat"))
            if mutable:
                raise ValueError(
                    f"Parallel: stacked layers holding {mutable} variables (Dropout / BatchNorm state) are not "
                    "supported yet; pass the blocks as a list (Units(stacked=False))"
                )
            self.block_states = None
            blocks = {}
        else:
            placed = nnx.to_pure_dict(in_model)
            for i, own in enumerate(self.block_rests):
                if jax.tree.structure(nnx.to_pure_dict(own)) != jax.tree.structure(placed.get(i, {})):
                    raise ValueError(
                        f"Parallel: block {i} shares non-parameter variables with another part of the model; every "
                        "block must own its variables (give each block its own, e.g. its own dropout RNG stream)"
                    )
            self.block_states = [ModelState(r) for r in self.block_rests]
            blocks = {i: ms.store(r) for i, (ms, r) in enumerate(zip(self.block_states, self.block_rests, strict=True))}
        self.initial_model_state = {"outer": self.outer_state.store(outer_rest), "blocks": blocks}

    def rest_of(self, model_state) -> nnx.State:
        """The model's non-parameter variables from the train state's `model_state`."""
        rest = dict(self.outer_state.load(model_state["outer"]))
        if self.block_states is not None and self.blocks_fixed:
            loaded = {i: ms.load(model_state["blocks"][i]) for i, ms in enumerate(self.block_states)}
            rest[self.units.blocks] = nnx.State(loaded)
        elif self.blocks_fixed:
            rest.update(self.blocks_fixed)
        return nnx.State(rest)

    def block_prefix(self, i: int) -> tuple:
        """The path of block `i`'s parameters (of the stacked module, for a stacked layer)."""
        return (self.units.blocks,) if self.units.stacked else (self.units.blocks, i)

    def is_block_path(self, path: tuple) -> bool:
        return path[0] == self.units.blocks

    def plan_modules(self, model) -> list:
        """The model's modules as the plan sees them: a stacked module as one layer (its own
        parameter shapes without the layer axis) at the stacked module's path."""
        if not self.units.stacked:
            return list(nnx.iter_graph(model))
        name = self.units.blocks
        outer = [(path, m) for path, m in nnx.iter_graph(model) if not path or path[0] != name]
        return outer + [((name, *path), m) for path, m in nnx.iter_graph(self.first_layer)]

    @model_sharding_dropped()  # the units' code traced as on one device: the model's own sharding calls are no-ops
    def resolve_plan(self, cfg: Options, model, batch) -> ResolvedPlan:
        """The plan on the model (`TPPlan.resolve`): from one trace of the units on the model as on one
        device (shapes only), the placed layers' equations and the order each unit calls them in."""
        units, log = self.units, CallLog(cfg.plan, cfg.sequence_parallel)

        def trace(params, batch, rest, layer_rest):  # variables enter as inputs: RNG counts mutate in the trace
            model = log.watch(nnx.merge(self.graphdef, params, rest))
            with log.unit("the embed"):
                x = units.embed(model, batch)
            for i in range(1 if units.stacked else self.n_blocks):
                if units.stacked:  # one layer of the stacked module: all run its code
                    layer = layer_of(params[units.blocks], 0)
                    block = log.watch(nnx.merge(self.block_defs[0], layer, layer_rest), (units.blocks,))
                else:
                    block = getattr(model, units.blocks)[i]
                with log.unit(f"block {i}"):
                    call_block(i, block, x, batch, units.block_call)
            with log.unit("the head"):
                units.head_loss(model, x, batch)
            return jnp.zeros(())

        layer_rest = self.block_rests[0] if units.stacked else None
        jax.eval_shape(trace, abstract(self.pure), abstract(batch), abstract(self.rest), abstract(layer_rest))
        return cfg.plan.resolve(self.plan_modules(model), cfg.tp, log)
