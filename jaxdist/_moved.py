"""Modules that moved when the package took its layer folders: importing an old path fails on one
line that names the new one (CHANGELOG.md lists them)."""

from __future__ import annotations

import importlib.abc
import sys

MOVED = {
    "jaxdist._compat": "jaxdist.compat",
    "jaxdist._step": "jaxdist.core.step",
    "jaxdist.canonical": "jaxdist.core.canonical",
    "jaxdist.contract": "jaxdist.core.contract",
    "jaxdist.model_state": "jaxdist.core.model_state",
    "jaxdist.per_leaf": "jaxdist.core.per_leaf",
    "jaxdist._native": "jaxdist.comm.native",
    "jaxdist._interleave": "jaxdist.ddp.interleave",
    "jaxdist.buckets": "jaxdist.ddp.buckets",
    "jaxdist._pipeline": "jaxdist.engine.prefetch",
    "jaxdist._residuals": "jaxdist.engine.residuals",
    "jaxdist.fsdp": "jaxdist.engine.fsdp",
    "jaxdist.tp_plan": "jaxdist.tp.plan",
    "jaxdist._tp_grads": "jaxdist.tp.grads",
    "jaxdist.pipeline_schedule": "jaxdist.pipeline.schedule",
    "jaxdist.train.gpt": "jaxdist.models.gpt",
    "jaxdist.train.shards": "jaxdist.train.data.shards",
    "jaxdist.train.prepare": "jaxdist.train.data.prepare",
    "jaxdist.train.tokenize": "jaxdist.train.data.tokenize",
}


class MovedModules(importlib.abc.MetaPathFinder):
    """Consulted only after the normal finders found nothing: an old path gets the new one."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            raise ModuleNotFoundError(f"{fullname} moved to {MOVED[fullname]}: import it from there", name=fullname)
        return None


def install() -> None:
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())
