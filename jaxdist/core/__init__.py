"""What every strategy shares: the train state and step, the run contract, the canonical form,
model state and per-leaf optimizer state (and `runs`, cutting a sequence into runs of bounded size).

Above `jaxdist.comm` and `jaxdist.compat` (the shims over JAX internals), below every strategy;
nothing here knows which strategy runs. Names load on first use.
"""

import importlib

_EXPORTS = {
    "TrainState": "jaxdist.core.step",
    "PlacedStep": "jaxdist.core.step",
    "Run": "jaxdist.core.contract",
    "ModelState": "jaxdist.core.model_state",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxdist.core' has no attribute {name!r}")
