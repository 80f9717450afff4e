"""Placements: how one layer splits over `tp` (`column`, `row`, `vocab`, `replicated`), and the
einsum equations that say which of a weight's axes are output features and which contracted.

A `jaxdist.tp.TPPlan` maps module paths to these (`jaxdist.tp.plan` says what each placement means).
"""

from __future__ import annotations

import dataclasses

from flax import nnx


@dataclasses.dataclass(frozen=True)
class Placement:
    """How one layer splits over `tp`: `kind` is "column", "row", "vocab" or "replicated"; `dim` and
    `param` name the weight and its split dimension (None: the layer type's default)."""

    kind: str
    groups: int = 1
    gather_output: bool = False
    loss_parallel: bool = False
    dim: int | str | None = None
    param: str | None = None

    def __post_init__(self):
        if self.kind not in ("column", "row", "vocab", "replicated"):
            raise ValueError(f"Placement kind must be column, row, vocab or replicated, got {self.kind!r}")
        if self.loss_parallel and (self.gather_output or self.kind not in ("column", "vocab")):
            raise ValueError("Placement: loss_parallel is for a column head or a vocab embedding's attend, ungathered")
        if not isinstance(self.groups, int) or self.groups < 1:
            raise ValueError(f"Placement groups must be an int >= 1, got {self.groups!r}")
        if self.dim is not None and not isinstance(self.dim, (int, str)):
            raise ValueError(f"Placement dim must be an int, an axis name or None, got {self.dim!r}")
        if (self.dim is not None or self.param is not None) and self.kind not in ("column", "row"):
            raise ValueError(f"Placement: dim and param are for column and row layers, not {self.kind}")

    def split_dim(self, param: str, ndim: int) -> int | None:
        """The dimension of parameter `param` split over tp, by the names and dims of an `nnx.Linear` or an
        `nnx.Embed` (a layer of another kind or weight name: `TPPlan.resolve` on the model)."""
        dim = self.dim if isinstance(self.dim, int) else None
        if self.kind == "column" and param in (self.param or "kernel", "bias"):
            return ndim - 1 if dim is None or param == "bias" else dim % ndim
        if self.kind == "row" and param == (self.param or "kernel"):
            return 0 if dim is None else dim % ndim
        if self.kind == "vocab" and param == "embedding":
            return 0
        return None


def column(
    groups: int = 1,
    gather_output: bool = False,
    loss_parallel: bool = False,
    *,
    dim: int | str | None = None,
    param: str | None = None,
) -> Placement:
    """Output features split over tp (Megatron's column-parallel linear).

    `dim`: the weight's split dimension, an output axis (index or axis name; default: the layer
    type's, see the module docstring); `param`: the weight's name. `gather_output` all-gathers the
    output over tp; `loss_parallel` (a head) keeps each rank's slice of the logits for
    `cross_entropy` below, so whole logits never exist on one rank.
    """
    return Placement("column", groups, gather_output, loss_parallel, dim, param)


def row(dim: int | str | None = None, *, param: str | None = None) -> Placement:
    """Input features split over tp, partial products summed (Megatron's row-parallel linear); `dim`
    (a contracted axis of the weight) and `param` as for `column`."""
    return Placement("row", dim=dim, param=param)


def vocab(loss_parallel: bool = False) -> Placement:
    """Embedding rows split over tp (vocabulary-parallel embedding; `attend`, a tied head, is column
    parallel: its logits gathered, or with `loss_parallel` kept per rank for `cross_entropy`)."""
    return Placement("vocab", loss_parallel=loss_parallel)


def replicated() -> Placement:
    return Placement("replicated")


# -- einsum equations: which of a weight's axes are output features, which contracted --------


@dataclasses.dataclass(frozen=True)
class Equation:
    """A two-operand einsum `x,w->out` of an input and a weight ("." stands for an ellipsis)."""

    x: str
    w: str
    out: str

    @classmethod
    def parse(cls, text: str, weight_ndim: int) -> Equation | None:
        """The equation of `text` with the operand of `weight_ndim` axes as the weight (the second
        one when both fit), or None if it is not such an equation."""
        text = text.replace(" ", "").replace("...", ".")
        if text.count("->") != 1 or text.count(",") != 1:
            return None
        ins, out = text.split("->")
        x, w = ins.split(",")
        if len(w) != weight_ndim or "." in w:
            x, w = w, x
        if len(w) != weight_ndim or "." in w or not w.isalpha():
            return None
        return cls(x, w, out)

    def outputs(self) -> str:
        """The weight's output feature axes in output order: those after the output's first axis it
        shares with the input (a leading stacked axis, as q/k/v's 3 in 'BTD,SNDH->SBTNH', is none)."""
        shared = [i for i, c in enumerate(self.out) if c == "." or c in self.x]
        tail = self.out[shared[0] + 1 :] if shared else self.out
        return "".join(c for c in tail if c in self.w and c not in self.x)

    def contracted(self) -> str:
        """The weight's axes summed with the input's, in the input's order."""
        return "".join(c for c in self.x if c in self.w and c not in self.out)

    def out_axis(self, letter: str) -> int:
        """The output axis of `letter` (negative when it follows an ellipsis)."""
        i = self.out.index(letter)
        return i - len(self.out) if "." in self.out[:i] else i

    def x_axis(self, letter: str) -> int:
        i = self.x.index(letter)
        return i - len(self.x) if "." in self.x[:i] else i


LINEAR = Equation(".i", "io", ".o")  # nnx.Linear: a kernel (in, out) on the last axis of the input


def weight_name(module) -> str | None:
    """`kernel`, else the module's one parameter of two or more dimensions, else None."""
    if isinstance(getattr(module, "kernel", None), nnx.Param):
        return "kernel"
    found = [k for k, v in vars(module).items() if isinstance(v, nnx.Param) and v.ndim >= 2]
    return found[0] if len(found) == 1 else None
