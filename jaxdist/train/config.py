"""Training configuration: dataclasses, TOML files and `section.key=value` overrides.

A config is five sections (`model`, `parallel`, `optim`, `data`, `run`). Files
and overrides are checked key by key, so a typo fails at once with a one-line
error that names the valid keys.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A bad configuration; the message is one line and names the fix."""


@dataclasses.dataclass
class ModelConfig:
    flavor: str = "tiny"  # a key of jaxdist.train.gpt.FLAVORS; the fields below override it when set
    n_layers: int | None = None
    d_model: int | None = None
    n_heads: int | None = None
    seq_len: int | None = None
    vocab_size: int | None = None
    tie_embeddings: bool | None = None
    dtype: str = "float32"  # compute dtype: float32 or bfloat16


@dataclasses.dataclass
class ParallelConfig:
    dp: int = -1  # -1: every device not used by fsdp and tp
    fsdp: int = 1
    tp: int = 1
    zero1: bool = True  # DDP only (FSDP and TP always shard the optimizer state)
    bucket_mb: float = 40.0
    buffers: int = 2  # FSDP
    update_in_backward: bool = False  # FSDP
    sequence_parallel: bool = False  # TP
    remat: bool = True  # TP
    backend: str = "xla"  # comm backend: xla or nccl


@dataclasses.dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    max_grad_norm: float = 1.0  # 0 disables clipping
    accumulation_steps: int = 1  # DDP only


@dataclasses.dataclass
class DataConfig:
    source: str = "text"  # "text" (the file below, prepared into out_dir/data), "shards" or "synthetic"
    path: str = ""  # text: a text file (default: the shipped corpus); shards: a `jaxdist prepare-data` directory
    batch_size: int = 16  # global, sequences per step
    tokenizer: str = "bytes"  # text: "bytes", "bpe:N" (learnt on the text) or a tokenizer.json path
    val_fraction: float = 0.1  # text: the share of the file held out for validation
    stride: int = 0  # training: tokens between the starts of consecutive sequences; 0: seq_len (no overlap)


@dataclasses.dataclass
class RunConfig:
    steps: int = 200
    seed: int = 0
    out_dir: str = "runs/tiny"
    log_every: int = 10
    checkpoint_every: int = 100  # 0: only at the end
    keep_checkpoints: int = 2
    resume: bool = True  # continue from the newest checkpoint in out_dir if there is one
    eval_every: int = 0  # validation loss every this many steps and at the end; 0: never
    eval_batches: int = 4  # validation batches (of data.batch_size) per evaluation
    sample_tokens: int = 0  # at the end, print this many generated tokens after sample_prompt
    sample_prompt: str = ""
    tensorboard: bool = False
    progress: bool = True


@dataclasses.dataclass
class TrainConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _fields(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """`value` (from TOML, or a string from the command line) as the field's type."""
    args = typing.get_args(hint)
    allowed = [a for a in args if a is not type(None)] or [hint]
    if value is None or (isinstance(value, str) and value.lower() == "none" and type(None) in args):
        if type(None) in args:
            return None
        raise ConfigError(f"{where} cannot be none; give a {allowed[0].__name__}")
    for t in allowed:
        try:
            if t is bool:
                if isinstance(value, bool):
                    return value
                if str(value).lower() in ("true", "1", "yes", "on"):
                    return True
                if str(value).lower() in ("false", "0", "no", "off"):
                    return False
                raise ValueError
            if t is int and isinstance(value, float) and not value.is_integer():
                raise ValueError
            return t(value)
        except (TypeError, ValueError):
            continue
    raise ConfigError(f"{where} must be a {' or '.join(t.__name__ for t in allowed)}, got {value!r}")


def apply(cfg: TrainConfig, section: str, key: str, value: Any) -> None:
    sections = _fields(TrainConfig)
    if section not in sections:
        raise ConfigError(f"unknown config section '{section}'; valid sections: {', '.join(sections)}")
    sub = getattr(cfg, section)
    fields = _fields(type(sub))
    if key not in fields:
        raise ConfigError(f"unknown config key '{section}.{key}'; valid keys in [{section}]: {', '.join(fields)}")
    setattr(sub, key, _coerce(value, fields[key], f"{section}.{key}"))


def load(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Defaults, then the TOML file at `path`, then `section.key=value` overrides."""
    cfg = TrainConfig()
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist; pass an existing .toml file") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"config file {path}: '{section}' must be a [section] table")
            for key, value in values.items():
                apply(cfg, section, key, value)
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"override {item!r} must look like section.key=value, e.g. run.steps=100")
        name, value = item.split("=", 1)
        section, key = name.split(".", 1)
        apply(cfg, section.strip(), key.strip(), value.strip())
    return cfg
