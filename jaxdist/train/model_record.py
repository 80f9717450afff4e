"""A model's config as a checkpoint records it, and the check that a resume or an export reads the same model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax

from jaxdist.train.config import ConfigError

# how the model computes (flash attention on NVIDIA GPUs, the loss in chunks): not what a checkpoint holds,
# so a GPU run's checkpoint resumes on CPU and back
PLATFORM_KEYS = ("attention", "loss_chunk")
DTYPE_KEYS = ("dtype", "param_dtype")


def dtype_name(value) -> str:
    """A dtype's name ("float32", "bfloat16"), also of the text an older jaxdist recorded for a scalar type
    ("<class 'jax.numpy.float32'>")."""
    if isinstance(value, str):
        value = re.findall(r"\w+", value)[-1]
    return jax.numpy.dtype(value).name


def model_record(model: dict) -> dict:
    """A model config (`jaxdist.models.families.record`) as JSON: dtypes by name, so `from_record` builds it."""
    return {k: dtype_name(v) if k in DTYPE_KEYS and v is not None else v for k, v in model.items()}


def _model_identity(model):
    """What makes two model records the same model: the config without the platform's choices."""
    if not isinstance(model, dict):
        return model
    return {k: v for k, v in model_record(model).items() if k not in PLATFORM_KEYS}


def check_same_model(meta: dict, model: dict, directory: Path) -> None:
    """Raise a one-line ConfigError naming each model setting in which the checkpoint's model differs."""
    saved = _model_identity(meta.get("model"))
    now = _model_identity(model)
    if saved == now:
        return
    if not isinstance(saved, dict):
        differences = f"it records no model config ({json.dumps(saved)[:100]})"
    else:
        differences = "saved vs now: " + ", ".join(
            f"model.{k} {_shown(saved, k)} vs {_shown(now, k)}"
            for k in sorted(saved.keys() | now.keys())
            if saved.get(k, _ABSENT) != now.get(k, _ABSENT)
        )
    raise ConfigError(
        f"the checkpoint in {directory} is for another model ({differences}); use a new run.out_dir "
        "(run.out_dir=DIR) for a new run, set run.overwrite=true to replace this one, or match the model settings"
    )


_ABSENT = object()


def _shown(record: dict, key: str) -> str:
    return json.dumps(record[key]) if key in record else "absent"
