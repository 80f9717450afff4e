"""Training configuration: dataclasses, TOML files and `section.key=value` overrides.

A config is five sections (`model`, `parallel`, `optim`, `data`, `run`). Files
and overrides are checked key by key, so a typo fails at once with a one-line
error that names the valid keys.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A bad configuration; the message is one line and names the fix."""


def _key(default: Any, help: str = "") -> Any:
    """A config key: its default and the one line `jaxdist train --help` shows for it."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass
class ModelConfig:
    flavor: str = _key("tiny", "a key of jaxdist.train.gpt.FLAVORS; the keys below override it when set")
    n_layers: int | None = _key(None, "transformer blocks")
    d_model: int | None = _key(None, "width")
    n_heads: int | None = _key(None, "attention heads (must divide d_model)")
    seq_len: int | None = _key(None, "tokens per sequence")
    vocab_size: int | None = _key(None, "vocabulary (>= 256 for byte-level text)")
    tie_embeddings: bool | None = _key(None, "share the input embedding with the head")
    dtype: str = _key("float32", "compute dtype: float32 or bfloat16")


@dataclasses.dataclass
class ParallelConfig:
    dp: int = _key(-1, "data-parallel size; -1: every device not used by fsdp, tp and pp")
    fsdp: int = _key(1, "FSDP size (> 1: FSDP, HSDP with dp > 1)")
    tp: int = _key(1, "tensor-parallel size (> 1: DP x TP)")
    zero1: bool = _key(True, "DDP: shard the optimizer state (FSDP and TP always do)")
    bucket_mb: float = _key(40.0, "DDP: gradient bucket size, MiB")
    buffers: int = _key(2, "FSDP: units gathered at once")
    update_in_backward: bool = _key(False, "FSDP: update each unit during backward (needs optim.max_grad_norm=0)")
    sequence_parallel: bool = _key(False, "TP: split activations between tp layers (batch rows if tp divides them)")
    remat: bool | str = _key(
        "auto",
        "block activations in backward: auto (kept, recomputed under FSDP), true (recomputed: less memory, one "
        "more forward) or false (kept; FSDP rebuilds only the weights' own residuals)",
    )
    backend: str = _key("xla", "comm backend: xla or nccl")
    comm_dtype: str = _key(
        "param",
        "dtype the collectives move: param (the parameters') or compute (model.dtype: weights gathered and "
        "gradients reduced in it, half the bytes with bfloat16, as XLA's automatic sharding does)",
    )
    pp: int = _key(1, "pipeline-parallel size (> 1: the GPT's blocks split into pp x virtual stages)")
    microbatches: int = _key(4, "pipeline: micro-batches per data rank's batch")
    schedule: str = _key("1f1b", "pipeline schedule: 1f1b, gpipe or interleaved")
    virtual: int = _key(1, "pipeline: stages per rank (interleaved schedule)")


@dataclasses.dataclass
class OptimConfig:
    lr: float = _key(3e-3, "peak learning rate (AdamW)")
    min_lr_ratio: float = _key(0.1, "final learning rate / lr")
    warmup_steps: int = _key(10, "linear warmup steps")
    decay_steps: int | None = _key(None, "schedule length (warmup + cosine); default run.steps of the first run")
    weight_decay: float = _key(0.0, "AdamW weight decay")
    no_decay: str = _key("wpe", "comma-separated regexes: parameters whose path matches get no weight decay")
    decay_vectors: bool = _key(False, "decay 1-D parameters (norm scales, biases) too; GPT recipes don't")
    b1: float = _key(0.9, "AdamW beta1")
    b2: float = _key(0.95, "AdamW beta2")
    max_grad_norm: float = _key(1.0, "clip by the global gradient norm; 0 disables clipping")
    accumulation_steps: int = _key(1, "DDP: micro-batches per step")


@dataclasses.dataclass
class DataConfig:
    source: str = _key("text", "text (data.path, prepared into out_dir/data), shards (a prepare-data dir) or synthetic")
    path: str = _key("", "text: a text file (default: the shipped corpus); shards: a `jaxdist prepare-data` directory")
    batch_size: int = _key(16, "global sequences per step")
    tokenizer: str = _key("bytes", "text: bytes, bpe:N (learnt on the text) or a tokenizer.json path")
    val_fraction: float = _key(0.1, "text: the share of the file held out for validation")
    stride: int = _key(0, "training: tokens between the starts of consecutive sequences; 0: seq_len (no overlap)")


@dataclasses.dataclass
class RunConfig:
    steps: int = _key(200, "train until this step")
    seed: int = _key(0, "parameters and batches")
    out_dir: str = _key("runs/tiny", "metrics.jsonl and checkpoints/")
    log_every: int = _key(10, "steps between metrics rows")
    checkpoint_every: int = _key(100, "steps between checkpoints; 0: only at the end; -1: none")
    keep_checkpoints: int = _key(2, "newest checkpoints kept")
    checkpoint_compress: bool = _key(False, "zstd-compress checkpoints (float32 state ~8% smaller, ~2x slower saves)")
    resume: bool = _key(True, "continue from the newest checkpoint in out_dir")
    init_from: str = _key("", "start a new run from these parameters (the OUT of `jaxdist export`); empty: none")
    overwrite: bool = _key(False, "start over in an out_dir that holds a run, deleting its checkpoints and metrics")
    eval_every: int = _key(0, "validation loss every this many steps and at the end; 0: never")
    eval_batches: int = _key(4, "validation batches (of data.batch_size) per evaluation")
    sample_tokens: int = _key(0, "at the end, print this many generated tokens after sample_prompt")
    sample_prompt: str = _key("", "the prompt of the end-of-run sample")
    tensorboard: bool = _key(False, "also write TensorBoard events (needs tensorboardX)")
    progress: bool = _key(True, "a progress bar (plain lines without a terminal)")
    step_timeout_s: float = _key(0.0, "a step running longer ends the process with a report (0: off)")


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


def validate(cfg: TrainConfig) -> None:
    """Values no run can use, and settings that contradict each other: a one-line ConfigError each."""
    positive = [("run.steps", cfg.run.steps), ("data.batch_size", cfg.data.batch_size)]
    positive += [
        ("optim.accumulation_steps", cfg.optim.accumulation_steps),
        ("optim.decay_steps", cfg.optim.decay_steps),
        ("run.keep_checkpoints", cfg.run.keep_checkpoints),  # below 1 kept one anyway, silently
    ]
    positive += [
        (f"model.{k}", getattr(cfg.model, k)) for k in ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size")
    ]
    for name, value in positive:
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    if not cfg.optim.max_grad_norm >= 0:  # a negative value read as no clipping, silently; NaN too
        raise ConfigError(f"optim.max_grad_norm must be >= 0 (0 disables clipping), got {cfg.optim.max_grad_norm}")
    if cfg.run.checkpoint_every < -1:  # -1 means none; anything lower read as none, silently
        raise ConfigError(
            f"run.checkpoint_every must be >= 1 (steps between checkpoints), 0 (only at the end) or -1 (none), "
            f"got {cfg.run.checkpoint_every}"
        )
    if cfg.parallel.comm_dtype not in ("param", "compute"):
        raise ConfigError(f"parallel.comm_dtype must be param or compute, got {cfg.parallel.comm_dtype!r}")
    if cfg.parallel.remat not in (True, False, "auto"):
        raise ConfigError(f"parallel.remat must be auto, true or false, got {cfg.parallel.remat!r}")
    if cfg.parallel.remat is False and cfg.parallel.pp > 1:
        raise ConfigError(
            "parallel.remat=false (keep activations) does not work with parallel.pp > 1: a stage's backward "
            "recomputes its forward; set it to auto"
        )
    if cfg.parallel.update_in_backward and cfg.optim.max_grad_norm > 0:
        # the strategy updates each unit before the global gradient norm exists, so clipping would be dropped
        raise ConfigError(
            "parallel.update_in_backward=true cannot clip by optim.max_grad_norm (units are updated before the "
            "global gradient norm exists); set optim.max_grad_norm=0 or parallel.update_in_backward=false"
        )


def describe() -> str:
    """Every section and key with its default and meaning, from the dataclasses (for `--help`)."""
    lines = []
    for section, cls in _fields(TrainConfig).items():
        lines.append(f"[{section}]")
        for f in dataclasses.fields(cls):
            default = "none" if f.default is None else json.dumps(f.default)
            lines.append(f"  {section}.{f.name} = {default}".ljust(40) + f"  {f.metadata.get('help', '')}".rstrip())
    return "\n".join(lines)
