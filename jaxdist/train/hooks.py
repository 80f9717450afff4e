"""What the trainer calls for data, evaluation and sampling, so its loop stays about training.

`source` builds the configured data, `Loader` reads it (jaxdist.train.data.shards),
`evaluator` gives the validation loss when `run.eval_every` asks for it,
`check_same_data` warns when a resumed run's data changed, `samples_before` says
where a resumed run's data stream continues, and `print_sample` ends a run with
generated text (`check_sample_prompt` refuses its prompt before training).
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxdist.models import families
from jaxdist.train.config import ConfigError, TrainConfig
from jaxdist.train.data import sources as data_lib
from jaxdist.train.data.shards import Loader, ShardData, data_changes, load_tokenizer
from jaxdist.train.evaluate import Evaluator
from jaxdist.train.report import warn

__all__ = ["Loader", "source", "evaluator", "check_same_data", "samples_before", "check_sample_prompt", "print_sample"]


def source(cfg: TrainConfig, split: str, model, out_dir: Path):
    """The `split` of the configured data (config problems as one-line ConfigErrors)."""
    if cfg.data.stride < 0:
        raise ConfigError(f"data.stride must be >= 0 (0: seq_len), got {cfg.data.stride}")
    progress = cfg.run.progress and jax.process_index() == 0
    try:
        return data_lib.make(cfg.data, split, model.vocab_size, model.seq_len, cfg.run.seed, out_dir, progress)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def evaluator(cfg: TrainConfig, model, out_dir: Path, sharding) -> Evaluator | None:
    """The validation-loss evaluator of the model config `model`'s family, or None when run.eval_every is 0."""
    if cfg.run.eval_every < 0:
        raise ConfigError(f"run.eval_every must be >= 0 (0: never), got {cfg.run.eval_every}")
    if cfg.run.eval_every == 0:
        return None
    if cfg.run.eval_batches < 1:
        raise ConfigError(f"run.eval_batches must be >= 1, got {cfg.run.eval_batches}")
    loader = Loader(source(cfg, "val", model, out_dir), cfg.data.batch_size, sharding)
    return Evaluator(loader, cfg.run.eval_batches, loss_fn=families.family_of(model).loss)


def check_same_data(meta: dict, data) -> None:
    """Batches are a function of (seed, step, data): say so when a checkpoint was made on other data
    (by content: the same data moved elsewhere is the same data)."""
    saved = meta.get("data")
    if saved is not None and (changes := data_changes(saved, data.state())):
        warn(f"the data changed since the checkpoint ({'; '.join(changes)}); batches differ from before")


def samples_before(meta: dict | None, step: int, batch_size: int) -> int:
    """How many samples of the data stream the steps before `step` read, by the checkpoint of `step` (its
    record, or its config's batch size for a checkpoint of an older jaxdist); 0 for a new run."""
    if meta is None:
        return 0
    if "data_samples" in meta:
        return meta["data_samples"]
    return step * ((meta.get("config") or {}).get("data") or {}).get("batch_size", batch_size)


def check_sample_prompt(cfg: TrainConfig, model, data) -> None:
    """Refuse a run.sample_prompt the end-of-run sample could not use now, not after training."""
    if cfg.run.sample_tokens <= 0:
        return
    from jaxdist.train.sample import prompt_ids

    tokenizer = load_tokenizer(data.directory) if isinstance(data, ShardData) else None
    try:
        prompt_ids(tokenizer, cfg.run.sample_prompt, model.vocab_size, option="run.sample_prompt")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def print_sample(cfg: TrainConfig, model, data) -> None:
    """Generate run.sample_tokens tokens after run.sample_prompt with `model` and print them (process 0)."""
    from jaxdist.train.sample import sample_text

    # every process takes part in gathering the parameters; process 0 then decodes on one device
    host = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), nnx.state(model))
    if jax.process_index() != 0:
        return
    local = nnx.merge(nnx.graphdef(model), host)
    tokenizer = load_tokenizer(data.directory) if isinstance(data, ShardData) else None
    text = sample_text(local, tokenizer, cfg.run.sample_prompt, cfg.run.sample_tokens, temperature=0.8, top_k=20)
    print(f"jaxdist: sample after {cfg.run.steps} steps:\n{text}", flush=True)
