"""`run.init_from = "hf:DIR"`: a new run starts from a Hugging Face checkpoint directory.

The directory's config.json sets the model (family and config; `model.*` keys that contradict it
are refused, naming both values; model.seq_len sets the training length, at most the checkpoint's
max_position_embeddings; model.dtype the compute dtype). Its weights are read straight onto the
strategy's canonical shardings (each device reads its own slices: `jaxdist.models.hf.load_params`)
and converted to the strategy's layout with `from_canonical`; the optimizer state is initialised
on them. A tokenizer.json beside them becomes the run's tokenizer where the data is text tokenized
as bytes by default.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxdist.core.step import TrainState
from jaxdist.models import families, hf, hf_config
from jaxdist.models.hf_config import HFConfigError
from jaxdist.train.config import ConfigError, TrainConfig
from jaxdist.train.data.tokenize import TOKENIZER_FILE

PREFIX = "hf:"
# model.* keys a run may set, and the config.json key each must then agree with
AGREE = {
    "n_layers": "num_hidden_layers",
    "d_model": "hidden_size",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "d_ff": "intermediate_size",
    "vocab_size": "vocab_size",
    "tie_embeddings": "tie_word_embeddings",
    "sliding_window": "sliding_window",
}
DEFAULT_FAMILY = "gpt"  # model.family's default: a run from hf:DIR takes the directory's


def directory(init_from: str) -> Path | None:
    """The Hugging Face directory of `run.init_from = "hf:DIR"`, None for any other value."""
    return Path(init_from[len(PREFIX) :]).expanduser() if init_from.startswith(PREFIX) else None


def source_of(meta: dict) -> Path | None:
    """The hf:DIR a checkpoint's run started from (its metadata's run.init_from), None for any other run
    (runs before 2026-12-05 kept DIR as given: relative to the directory the run was started in)."""
    return directory(((meta.get("config") or {}).get("run") or {}).get("init_from", ""))


def make_absolute(cfg: TrainConfig) -> None:
    """run.init_from as an absolute path: the run's checkpoints keep it, and `jaxdist export` and `jaxdist
    sample` read DIR's config.json and tokenizer files from it, from whatever working directory."""
    value = cfg.run.init_from
    if value:
        prefix = PREFIX if value.startswith(PREFIX) else ""
        cfg.run.init_from = prefix + str(Path(value[len(prefix) :]).expanduser().absolute())


def model_of(cfg: TrainConfig) -> hf.HFModel:
    """The model config.json describes, with the run's training length and compute dtype."""
    where = directory(cfg.run.init_from)
    try:
        family, kwargs = hf_config.read(hf_config.load_json(where))
    except HFConfigError as e:
        raise ConfigError(f"run.init_from={cfg.run.init_from}: {e}") from None
    m = cfg.model
    if m.family not in (DEFAULT_FAMILY, family):
        raise ConfigError(
            f"model.family={m.family} contradicts {where / 'config.json'}, a {family} model; "
            f"leave model.family unset with run.init_from={cfg.run.init_from}"
        )
    for key, hf_key in AGREE.items():
        ours = getattr(m, key, None)
        theirs = kwargs.get(key, True)  # Gemma has no tie_embeddings: its head is always the embedding
        if key == "sliding_window" and ours == 0:
            ours = None  # 0: no window
        if ours is not None and ours != theirs:
            raise ConfigError(
                f"model.{key}={ours} contradicts {hf_key}={theirs} in {where / 'config.json'}; "
                f"leave model.{key} unset with run.init_from={cfg.run.init_from}"
            )
    longest = kwargs["seq_len"]
    if m.seq_len is not None and m.seq_len > longest:
        raise ConfigError(
            f"model.seq_len={m.seq_len} is longer than max_position_embeddings={longest} in {where / 'config.json'}; "
            f"set model.seq_len <= {longest}"
        )
    if m.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"model.dtype must be float32 or bfloat16, got {m.dtype!r}")
    overrides = {"seq_len": m.seq_len or longest, "dtype": jnp.dtype(m.dtype)}
    if m.dtype == "bfloat16" and jax.default_backend() == "gpu":
        overrides["attention"] = "cudnn"  # flash attention
    try:
        return hf.read_config(where, **overrides)
    except (HFConfigError, ValueError) as e:
        raise ConfigError(f"run.init_from={cfg.run.init_from}: {e}") from None


def use_tokenizer(cfg: TrainConfig) -> None:
    """Text data tokenized as bytes (the default) is tokenized with the checkpoint's tokenizer.json instead."""
    where = directory(cfg.run.init_from)
    if where is not None and cfg.data.source == "text" and cfg.data.tokenizer == "bytes":
        if (where / TOKENIZER_FILE).is_file():
            cfg.data.tokenizer = str((where / TOKENIZER_FILE).absolute())


def load_state(run, optimizer, mcfg, init_from: str) -> TrainState:
    """The run's initial state with the checkpoint's weights: read onto the canonical shardings (no device
    holds more than its share), the optimizer initialised on them, converted to the run's layout."""
    target = run.canonical_target()
    model = hf.HFModel(families.family_of(mcfg).name, mcfg, "")
    try:
        params = hf.load_params(directory(init_from), model, target.params)
    except (hf.HFCheckpointError, HFConfigError) as e:
        raise ConfigError(f"run.init_from={init_from}: {e}") from None
    shardings = jax.tree.map(lambda x: x.sharding, target.opt_state)
    opt_state = jax.jit(optimizer.init, out_shardings=shardings)(params)
    start = run.canonical(run.state)
    return run.from_canonical(dataclasses.replace(start, params=params, opt_state=opt_state))
