"""jaxdist: multi-GPU training for JAX/Flax with explicit communication schedules.

The public face: the strategies (`DDP`, `FSDP`, `Parallel` with `Units`, `Pipelined`), tensor-parallel
plans (`TPPlan`), the run contract every strategy's `prepare` meets (`Run`, `TrainState`) and the
collectives (`comm`). Everything else is reached through its module (`jaxdist.tp.column`,
`jaxdist.models.GPT`, ...).
"""

from jaxdist._xla_flags import apply_default_flags

apply_default_flags()  # before anything below can start a JAX backend

import importlib  # noqa: E402

from jaxdist import _moved, comm  # noqa: E402

_moved.install()  # an old module path (jaxdist.tp_plan, ...) fails naming its new one

__version__ = "0.1.0"

# name -> module; imported on first use, so `import jaxdist` stays as light as `jaxdist.comm`
_EXPORTS = {
    "DDP": "jaxdist.ddp",
    "FSDP": "jaxdist.engine.fsdp",
    "Parallel": "jaxdist.engine",
    "Units": "jaxdist.engine",
    "Pipelined": "jaxdist.pipeline",
    "TPPlan": "jaxdist.tp.plan",
    "Run": "jaxdist.core.contract",
    "TrainState": "jaxdist.core.step",
}

__all__ = ["comm", "__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxdist' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
