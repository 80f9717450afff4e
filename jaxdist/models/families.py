"""The model families by name: what the trainer, evaluation, sampling and checkpoints need of each.

`FAMILIES["llama"]` gives the config and model classes, the named flavors, the units and whole-model
loss, the TP plan and its divisibility check. A config's family is `family_of(cfg)`; a checkpoint
records it (`record`) and `from_record` builds the config again (a record without a family is a GPT's,
as checkpoints of the GPT always were).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp

from jaxdist.engine.run import Units
from jaxdist.models import gemma, gpt, llama


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: `model(config, rngs)` builds it; `flavors` are its named configs."""

    name: str
    config: type
    model: type
    flavors: Mapping[str, Any]
    units: Units
    loss: Callable  # next_token_loss(model, batch) -> mean loss: DDP's and the evaluation's
    tp_plan_for: Callable
    check_tp: Callable[[Any, int], None]

    def flops_per_token(self, cfg) -> float:
        if hasattr(cfg, "flops_per_token"):
            return cfg.flops_per_token()
        # the GPT: 6 N (matmuls, forward and backward) + 12 L d T (attention scores and values)
        return 6 * cfg.num_params() + 12 * cfg.n_layers * cfg.d_model * cfg.seq_len


def _gpt_check_tp(cfg: gpt.GPTConfig, tp: int) -> None:
    for name, value in (("n_heads", cfg.n_heads), ("vocab_size", cfg.vocab_size), ("d_ff", cfg.ff)):
        if value % tp:
            raise ValueError(f"{name}={value} is not divisible by tp={tp}; choose a tp that divides {value}")


FAMILIES = {
    "gpt": Family(
        "gpt", gpt.GPTConfig, gpt.GPT, gpt.FLAVORS, gpt.UNITS, gpt.next_token_loss, gpt.tp_plan_for, _gpt_check_tp
    ),
    "llama": Family(
        "llama",
        llama.LlamaConfig,
        llama.Llama,
        llama.FLAVORS,
        llama.UNITS,
        llama.next_token_loss,
        llama.tp_plan_for,
        llama.check_tp,
    ),
    "gemma": Family(
        "gemma",
        gemma.GemmaConfig,
        gemma.Gemma,
        gemma.FLAVORS,
        gemma.UNITS,
        gemma.next_token_loss,
        gemma.tp_plan_for,
        gemma.check_tp,
    ),
}


def get(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; choose one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of(cfg) -> Family:
    """The family whose config class `cfg` is (or whose model `cfg` is)."""
    cfg = getattr(cfg, "cfg", cfg)
    for family in FAMILIES.values():
        if isinstance(cfg, family.config):
            return family
    raise ValueError(f"{type(cfg).__name__} is the config of no model family ({', '.join(FAMILIES)})")


def record(cfg) -> dict:
    """`dataclasses.asdict(cfg)` with the family's name (none for the GPT, as its checkpoints always were)."""
    family = family_of(cfg)
    fields = dataclasses.asdict(cfg)
    return fields if family.name == "gpt" else {"family": family.name, **fields}


def from_record(values: Mapping) -> Any:
    """The config a `record` (a checkpoint's model record: dtypes by name) describes."""
    values = dict(values)
    family = get(values.pop("family", "gpt"))
    names = {f.name for f in dataclasses.fields(family.config)}
    values = {k: v for k, v in values.items() if k in names}
    for k in ("dtype", "param_dtype"):
        if isinstance(values.get(k), str):  # str() of a dtype ("float32") or of a scalar type ("<class '...'>")
            values[k] = jnp.dtype(re.findall(r"\w+", values[k])[-1])
    return family.config(**values)
