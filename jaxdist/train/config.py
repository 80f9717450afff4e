"""Training configuration: dataclasses, TOML files and `section.key=value` overrides.

A config is five sections (`model`, `parallel`, `optim`, `data`, `run`). Files
and overrides are checked key by key, so a typo fails at once with a one-line
error that names the valid keys. Every numeric key declares the values it
accepts (a `Range`, shown by `jaxdist train --help`); `check_ranges` refuses any
other, NaN and infinities included, in one line naming the key, the value and
the range.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import typing
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A bad configuration; the message is one line and names the fix."""


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric key accepts: the finite numbers between `low` and `high` (either end open or
    closed, or absent), plus the special values in `also` (value: what it means). `meaning` says what the
    interval's values do, where that helps. NaN and infinities are never in a range."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    meaning: str = ""
    also: tuple[tuple[float, str], ...] = ()

    def __contains__(self, value: float) -> bool:
        if any(value == v for v, _ in self.also):
            return True
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def __str__(self) -> str:
        lo, hi = _number(self.low), _number(self.high)
        if self.low is not None and self.high is not None:
            text = f"in {'(' if self.low_open else '['}{lo}, {hi}{')' if self.high_open else ']'}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {lo}"
        else:
            text = f"{'<' if self.high_open else '<='} {hi}" if self.high is not None else "finite"
        parts = [_with_meaning(text, self.meaning), *(_with_meaning(_number(v), m) for v, m in self.also)]
        return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


def _number(x: float | None) -> str:
    return f"{x:g}" if x is not None else ""


def _with_meaning(text: str, meaning: str) -> str:
    return f"{text} ({meaning})" if meaning else text


def at_least(low: float, meaning: str = "", also: tuple[tuple[float, str], ...] = ()) -> Range:
    """`>= low`, plus the special values `also` ((value, what it means), ...)."""
    return Range(low=low, meaning=meaning, also=also)


def above(low: float) -> Range:
    return Range(low=low, low_open=True)


def between(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Range:
    return Range(low=low, high=high, low_open=low_open, high_open=high_open)


def _key(default: Any, help: str = "", allowed: Range | None = None) -> Any:
    """A config key: its default, the one line `jaxdist train --help` shows for it, and (numbers) its range."""
    return dataclasses.field(default=default, metadata={"help": help, "range": allowed})


COUNT = at_least(1)  # sizes and counts: at least one


@dataclasses.dataclass
class ModelConfig:
    flavor: str = _key("tiny", "a named size of model.family (its FLAVORS); the size keys below override it when set")
    n_layers: int | None = _key(None, "transformer blocks", COUNT)
    d_model: int | None = _key(None, "width", COUNT)
    n_heads: int | None = _key(None, "attention heads (gpt: must divide d_model)", COUNT)
    n_kv_heads: int | None = _key(None, "llama, gemma: key/value heads (must divide n_heads)", COUNT)
    head_dim: int | None = _key(None, "llama, gemma: features per head (even)", COUNT)
    d_ff: int | None = _key(None, "MLP hidden features (gpt default: 4 x d_model)", COUNT)
    seq_len: int | None = _key(None, "tokens per sequence", COUNT)
    vocab_size: int | None = _key(None, "vocabulary (>= 256 for byte-level text)", COUNT)
    tie_embeddings: bool | None = _key(None, "gpt, llama: share the input embedding with the head (gemma always does)")
    sliding_window: int | None = _key(
        None,
        "llama, gemma: tokens a (gemma: local) layer attends to, itself included",
        at_least(1, also=((0, "no window; gemma: every layer global"),)),
    )
    loss_chunk: int | None = _key(
        None, "gpt: tokens per chunk of the head's cross-entropy: the batch's float32 logits never exist at once", COUNT
    )
    dtype: str = _key("float32", "compute dtype: float32 or bfloat16")
    family: str = _key("gpt", "gpt, llama (Llama 3, Qwen 2 / 3, Mistral) or gemma (Gemma 3); see docs/models.md")


@dataclasses.dataclass
class ParallelConfig:
    dp: int = _key(-1, "data-parallel size", at_least(1, also=((-1, "every device not used by fsdp, tp, cp and pp"),)))
    fsdp: int = _key(1, "FSDP size (> 1: FSDP, HSDP with dp > 1)", COUNT)
    tp: int = _key(1, "tensor-parallel size (> 1: DP x TP)", COUNT)
    zero1: bool = _key(True, "DDP: shard the optimizer state (FSDP and TP always do)")
    bucket_mb: float = _key(40.0, "DDP: gradient bucket size, MiB", above(0))
    pack_buckets: bool = _key(
        True,
        "copy each DDP bucket (each FSDP/TP/pipeline unit) into one buffer per dtype for its collectives; false: "
        "grouped collectives over its parameters themselves, no flat buffers",
    )
    buffers: int = _key(2, "FSDP: units gathered at once", at_least(2))
    update_in_backward: bool = _key(False, "FSDP: update each unit during backward (needs optim.max_grad_norm=0)")
    sequence_parallel: bool = _key(False, "TP: split activations between tp layers (batch rows if tp divides them)")
    remat: bool | str = _key(
        "auto",
        "block activations in backward: auto (kept, recomputed under FSDP; kept under pp), true (recomputed: less "
        "memory, one more forward) or false (kept; FSDP rebuilds only the weights' own residuals)",
    )
    backend: str = _key("xla", "comm backend: xla or nccl (NVIDIA GPUs only)")
    comm_dtype: str = _key(
        "param",
        "dtype the collectives move: param (the parameters') or compute (model.dtype: weights gathered and "
        "gradients reduced in it, half the bytes with bfloat16, as XLA's automatic sharding does)",
    )
    cp: int = _key(1, "context-parallel size (> 1: sequences split over cp; seq_len must divide by 2 cp)", COUNT)
    pp: int = _key(1, "pipeline-parallel size (> 1: the model's blocks split into pp x virtual stages)", COUNT)
    microbatches: int = _key(4, "pipeline: micro-batches per data rank's batch", COUNT)
    schedule: str = _key("1f1b", "pipeline schedule: 1f1b, gpipe, interleaved or zb-h1 (zero bubble; alias zbh1)")
    virtual: int = _key(1, "pipeline: stages per rank (interleaved schedule)", COUNT)
    per_rank_programs: bool = _key(
        False,
        "pipeline: each process traces only its pp rank's ticks, with no switch on the rank (needs one pp "
        "rank per process, e.g. one process per GPU)",
    )


@dataclasses.dataclass
class OptimConfig:
    lr: float = _key(3e-3, "peak learning rate (AdamW)", above(0))
    min_lr_ratio: float = _key(0.1, "final learning rate / lr", between(0, 1))
    warmup_steps: int = _key(10, "linear warmup steps", at_least(0))
    decay_steps: int | None = _key(None, "schedule length (warmup + cosine); default run.steps of the first run", COUNT)
    weight_decay: float = _key(0.0, "AdamW weight decay", at_least(0))
    no_decay: str = _key("wpe", "comma-separated regexes: parameters whose path matches get no weight decay")
    decay_vectors: bool = _key(False, "decay 1-D parameters (norm scales, biases) too; GPT recipes don't")
    b1: float = _key(0.9, "AdamW beta1", between(0, 1, high_open=True))
    b2: float = _key(0.95, "AdamW beta2", between(0, 1, high_open=True))
    mu_dtype: str = _key(
        "float32",
        "dtype of AdamW's first moment: float32, or bfloat16 (opt-in: 2 bytes less state and optimizer traffic "
        "per parameter; changes the numerics)",
    )
    max_grad_norm: float = _key(1.0, "clip by the global gradient norm", at_least(0, "0 disables clipping"))
    accumulation_steps: int = _key(1, "DDP: micro-batches per step", COUNT)


@dataclasses.dataclass
class DataConfig:
    source: str = _key("text", "text (data.path, prepared into out_dir/data), shards (a prepare-data dir) or synthetic")
    path: str = _key("", "text: a text file (default: the shipped corpus); shards: a `jaxdist prepare-data` directory")
    batch_size: int = _key(16, "global sequences per step", COUNT)
    tokenizer: str = _key("bytes", "text: bytes, bpe:N (learnt on the text) or a tokenizer.json path")
    val_fraction: float = _key(
        0.1, "text: the share of the file held out for validation (0: none)", between(0, 1, high_open=True)
    )
    stride: int = _key(
        0,
        "training: tokens between the starts of consecutive sequences (seq_len: no overlap)",
        at_least(0, "0: seq_len"),
    )


DEFAULT_OUT_DIR = "runs/default"


@dataclasses.dataclass
class RunConfig:
    steps: int = _key(200, "train until this step", COUNT)
    seed: int = _key(0, "parameters and batches", at_least(0))
    out_dir: str = _key(
        DEFAULT_OUT_DIR, "metrics.jsonl and checkpoints/; default runs/<config file name>, runs/default without one"
    )
    log_every: int = _key(10, "steps between metrics rows", COUNT)
    checkpoint_every: int = _key(
        100,
        "when to save checkpoints",
        at_least(1, "steps between checkpoints", ((0, "only at the end"), (-1, "none"))),
    )
    keep_checkpoints: int = _key(2, "newest checkpoints kept", COUNT)
    checkpoint_compress: bool = _key(False, "zstd-compress checkpoints (float32 state ~8% smaller, ~2x slower saves)")
    resume: bool = _key(True, "continue from the newest checkpoint in out_dir")
    init_from: str = _key(
        "",
        "start a new run from these parameters: the OUT of `jaxdist export`, or hf:DIR (a Hugging Face model "
        "directory: its config.json sets the model); empty: none",
    )
    overwrite: bool = _key(False, "start over in an out_dir that holds a run, deleting its checkpoints and metrics")
    eval_every: int = _key(0, "validation loss every this many steps and at the end", at_least(0, "0: never"))
    eval_batches: int = _key(4, "validation batches (of data.batch_size) per evaluation", COUNT)
    sample_tokens: int = _key(0, "at the end, print this many generated tokens after sample_prompt", at_least(0))
    sample_prompt: str = _key("", "the prompt of the end-of-run sample")
    tensorboard: bool = _key(False, "also write TensorBoard events (needs tensorboardX)")
    progress: bool = _key(True, "a progress bar (plain lines without a terminal)")
    step_timeout_s: float = _key(0.0, "a step running longer ends the process with a report", at_least(0, "0: off"))
    max_skipped_steps: int = _key(
        10,
        "stop (non-zero exit) after this many consecutive steps skipped for a NaN/Inf loss or gradient",
        at_least(0, "0: never"),
    )


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
    if isinstance(value, str) and where not in VERBATIM:
        value = value.strip()
    if value is None or (isinstance(value, str) and value.lower() == "none" and type(None) in args):
        if type(None) in args:
            return None
        raise ConfigError(f"{where} cannot be none; give {TYPE_NAMES.get(allowed[0], allowed[0].__name__)}")
    for t in allowed:
        given = value.strip() if isinstance(value, str) and t is not str else value
        try:
            if t is bool:
                if isinstance(given, bool):
                    return given
                if str(given).lower() in ("true", "1", "yes", "on"):
                    return True
                if str(given).lower() in ("false", "0", "no", "off"):
                    return False
                raise ValueError
            if isinstance(given, bool) or (t is str and isinstance(given, list | dict)):
                raise ValueError  # TOML's true is no number (int(True) is 1), nor a list some text
            if t is int and isinstance(given, float) and not given.is_integer():
                raise ValueError
            return t(given)
        except (TypeError, ValueError):
            continue
    raise ConfigError(f"{where} must be {' or '.join(TYPE_NAMES.get(t, t.__name__) for t in allowed)}, got {value!r}")


TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "text"}
VERBATIM = ("run.sample_prompt",)  # text kept as typed, its spaces included (a BPE prompt's leading space)


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
    """Defaults, then the TOML file at `path`, then `section.key=value` overrides; every number checked
    against its key's range. A file that sets no `run.out_dir` runs in `runs/<its name without .toml>`,
    so two config files never share a run directory by default."""
    cfg = TrainConfig()
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist; pass an existing .toml file") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        cfg.run.out_dir = f"runs/{Path(path).stem}"
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
        apply(cfg, section.strip(), key.strip(), value)
    check_ranges(cfg)
    return cfg


def check_ranges(cfg: TrainConfig) -> None:
    """Raise a one-line ConfigError for the first number outside its key's declared range."""
    for section in _fields(TrainConfig):
        sub = getattr(cfg, section)
        for f in dataclasses.fields(sub):
            allowed, value = f.metadata.get("range"), getattr(sub, f.name)
            if allowed is None or value is None or isinstance(value, bool):
                continue
            if not isinstance(value, int | float) or value not in allowed:
                raise ConfigError(f"{section}.{f.name} must be {allowed}, got {value!r}")


def validate(cfg: TrainConfig) -> None:
    """Values no run can use, and settings that contradict each other: a one-line ConfigError each."""
    check_ranges(cfg)  # again: a TrainConfig built in code did not pass through `load`
    if cfg.parallel.comm_dtype not in ("param", "compute"):
        raise ConfigError(f"parallel.comm_dtype must be param or compute, got {cfg.parallel.comm_dtype!r}")
    if cfg.optim.mu_dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"optim.mu_dtype must be float32 or bfloat16, got {cfg.optim.mu_dtype!r}")
    if cfg.parallel.remat not in (True, False, "auto"):
        raise ConfigError(f"parallel.remat must be auto, true or false, got {cfg.parallel.remat!r}")
    if cfg.parallel.cp > 1 and cfg.optim.accumulation_steps > 1:
        raise ConfigError("optim.accumulation_steps > 1 works with DDP only; set it to 1 with parallel.cp > 1")
    if cfg.parallel.cp > 1 and cfg.parallel.update_in_backward:
        raise ConfigError("parallel.update_in_backward works with FSDP alone; set it to false with parallel.cp > 1")
    if cfg.parallel.per_rank_programs and cfg.parallel.pp < 2:
        raise ConfigError("parallel.per_rank_programs=true needs a pipeline; set parallel.pp >= 2 or turn it off")
    if not str(cfg.run.out_dir).strip():  # `run.out_dir=$RUN` with RUN unset: the working directory, cleared
        raise ConfigError("run.out_dir is empty; give the run's directory (run.out_dir=. for the working directory)")
    o = cfg.optim
    if o.decay_steps is not None and o.warmup_steps > 0 and o.decay_steps <= o.warmup_steps:
        raise ConfigError(
            f"optim.decay_steps={o.decay_steps} (the whole schedule, warmup included) is not longer than "
            f"optim.warmup_steps={o.warmup_steps}: no decay would be left; set optim.decay_steps above "
            f"{o.warmup_steps} or fewer warmup steps"
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
            allowed = f.metadata.get("range")
            text = f"{f.metadata.get('help', '')}" + (f" (must be {allowed})" if allowed else "")
            lines.append(f"  {section}.{f.name} = {default}".ljust(40) + f"  {text}".rstrip())
    return "\n".join(lines)
