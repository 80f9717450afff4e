"""`jaxdist sample RUN_DIR`: text from a run's newest checkpoint, decoded with a KV cache under `jit`.

The checkpoint's full parameters are restored onto one device, in the model family the checkpoint
records. The prompt is run once through the model's `decode` (prefill), then each new token costs
one single-position `decode` against the cached keys and values. When the context reaches the
model's `seq_len` (the GPT's learnt positions end there, and every family's cache), the cache is
rebuilt from the newest `seq_len // 2` tokens and decoding continues.
"""

from __future__ import annotations

import dataclasses
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdist.models import families


def _prefill(graphdef, state, tokens, length):
    model = nnx.merge(graphdef, state)
    logits, cache = model.decode(tokens, model.empty_cache(tokens.shape[0]), jnp.int32(0))
    return logits[:, length - 1].astype(jnp.float32), cache


def _decode(graphdef, state, cache, token, pos):
    logits, cache = nnx.merge(graphdef, state).decode(token[:, None], cache, pos)
    return logits[:, 0].astype(jnp.float32), cache


def _pick(logits, key, temperature, top_k: int, vocab: int):
    """Greedy at temperature 0, else a draw from softmax(logits / temperature) over the top_k (0: all),
    among the first `vocab` ids (those the tokenizer has: a model's vocabulary may be padded past it)."""
    logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab, logits, -jnp.inf)
    if top_k:
        # exactly k, by index: a threshold at the k-th value would keep every logit tied with it (bfloat16
        # logits tie often), and top_k=1 would then not be greedy
        values, indices = jax.lax.top_k(logits, top_k)
        rows = jnp.arange(logits.shape[0])[:, None]
        logits = jnp.full_like(logits, -jnp.inf).at[rows, indices].set(values)
    drawn = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6))
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


class Generator:
    """Token generation for one model on one device: `generate(prompt_ids, n, ...)`. It draws only ids below
    `vocab_size` (default: the model's; give the tokenizer's when the model's is padded past it)."""

    def __init__(self, model: nnx.Module, vocab_size: int | None = None):
        self.cfg = model.cfg
        self.vocab_size = vocab_size or model.cfg.vocab_size
        if not 1 <= self.vocab_size <= model.cfg.vocab_size:
            raise ValueError(
                f"the tokenizer has {self.vocab_size} tokens but the model {model.cfg.vocab_size}; "
                "use the tokenizer of the data the model was trained on"
            )
        self.graphdef, self.state = nnx.split(model)
        self.prefill = jax.jit(partial(_prefill, self.graphdef))
        self.decode = jax.jit(partial(_decode, self.graphdef), donate_argnums=(1,))
        self.pick = jax.jit(_pick, static_argnums=(3, 4))

    def generate(
        self, prompt: np.ndarray, tokens: int, *, temperature: float = 1.0, top_k: int = 0, seed: int = 0
    ) -> np.ndarray:
        """`tokens` new token ids following `prompt` (a non-empty 1-D array of ids)."""
        prompt = np.asarray(prompt)
        if prompt.ndim != 1 or prompt.size == 0:
            raise ValueError("the prompt must be at least one token; give a non-empty --prompt")
        if not np.issubdtype(prompt.dtype, np.integer) or prompt.min() < 0 or prompt.max() >= self.cfg.vocab_size:
            bad = next(t for t in prompt.tolist() if not (isinstance(t, int) and 0 <= t < self.cfg.vocab_size))
            raise ValueError(
                f"prompt token {bad} is not an id of the model's vocabulary (0 to {self.cfg.vocab_size - 1}); "
                "give token ids in that range"
            )
        # NaN would fail both tests below and sample greedily without a word
        if top_k < 0 or not (np.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"--top-k and --temperature must be finite and >= 0, got {top_k} and {temperature}")
        if tokens < 0 or not -(2**63) <= seed < 2**63:
            raise ValueError(f"--tokens must be >= 0 and --seed a 64-bit integer, got {tokens} and {seed}")
        prompt = prompt.astype(np.int32)
        top_k = min(top_k, self.vocab_size)
        ids = list(prompt.tolist())
        key = jax.random.key(seed)
        logits, cache, pos = self._fill(ids[-self.cfg.seq_len :])
        for i in range(tokens):
            token = self.pick(logits, jax.random.fold_in(key, i), jnp.float32(temperature), top_k, self.vocab_size)
            ids.append(int(token[0]))
            if i + 1 == tokens:
                break
            if pos == self.cfg.seq_len:  # no learnt position left: restart from the newest half
                logits, cache, pos = self._fill(ids[-(self.cfg.seq_len // 2) :])
            else:
                logits, cache = self.decode(self.state, cache, token, jnp.int32(pos))
                pos += 1
        return np.asarray(ids[len(prompt) :], np.int32)

    def _fill(self, ids: list[int]):
        padded = np.zeros((1, self.cfg.seq_len), np.int32)
        padded[0, : len(ids)] = ids
        logits, cache = self.prefill(self.state, padded, len(ids))
        return logits, cache, len(ids)


def model_config(meta_model: dict):
    """The model config a checkpoint's metadata records (its family's; dtypes are stored by name)."""
    return dataclasses.replace(families.from_record(meta_model), attention=None)  # one device, any platform


def load_run(run_dir: str | Path, data_dir: str | Path | None = None):
    """(model with the newest checkpoint's parameters, tokenizer or None, step) of a training run; the
    tokenizer is that of `data_dir`, by default the data directory the checkpoint was trained on."""
    from jaxdist.train.checkpoint import CheckpointError
    from jaxdist.train.data.prepare import INDEX
    from jaxdist.train.data.shards import content_id, load_tokenizer
    from jaxdist.train.export import read_params

    run_dir = Path(run_dir)
    if not (run_dir / "checkpoints").is_dir():
        raise ValueError(f"{run_dir} has no checkpoints; give the run.out_dir of a training run")
    try:  # the newest checkpoint that verifies against its checksums, as a resume reads
        step, meta, saved = read_params(run_dir)
    except CheckpointError as e:
        raise ValueError(str(e)) from None
    mcfg = model_config(meta["model"])
    model = families.family_of(mcfg).model(mcfg, nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(params, saved)  # only the parameters are read
    nnx.update(model, params)
    trained_on = (meta.get("data") or {}).get("dir")
    inside = run_dir / "data"  # where data.source=text prepares it: found again when the whole run moved
    if data_dir is None and trained_on and not Path(trained_on).is_dir() and (inside / INDEX).is_file():
        if content_id(inside) == meta["data"].get("content"):
            trained_on = str(inside)
    if data_dir is None and trained_on and not Path(trained_on).is_dir():
        raise ValueError(
            f"the data directory {trained_on} the run trained on (with its tokenizer) is gone; "
            "give where it is now with --data DIR"
        )
    data_dir = data_dir or trained_on
    tokenizer = load_tokenizer(data_dir) if data_dir else None
    if tokenizer is None:  # data without one (synthetic): a run from hf:DIR has the model's own
        tokenizer = _init_tokenizer(meta)
    return model, tokenizer, step


def _init_tokenizer(meta: dict):
    """The tokenizer.json of the Hugging Face directory a run started from (run.init_from=hf:DIR), if any."""
    from jaxdist.train.data.tokenize import TOKENIZER_FILE, from_file
    from jaxdist.train.hf_init import source_of

    source = source_of(meta)
    return from_file(source / TOKENIZER_FILE) if source and (source / TOKENIZER_FILE).is_file() else None


def prompt_ids(tokenizer, prompt: str, vocab_size: int, option: str = "--prompt") -> np.ndarray:
    """The token ids of `prompt`: encoded by `tokenizer`, or read as ids ("3 14 15") for a run without one
    (synthetic data); an empty prompt starts at a document boundary. Bad prompts raise a one-line
    ValueError naming `option`, the setting to change."""
    if tokenizer is None:
        try:
            ids = np.asarray([int(t) for t in prompt.split()] or [0])
        except ValueError:
            raise ValueError(
                f"this run has no tokenizer (synthetic data): give {option} as token ids, e.g. '3 14 15', "
                f"not {prompt!r}"
            ) from None
    else:
        ids = tokenizer.encode(prompt)
        if ids.size == 0:
            eot = tokenizer.end_of_text
            ids = np.asarray([eot if eot is not None else tokenizer.encode("\n")[0]])
    outside = ids[(ids < 0) | (ids >= vocab_size)]
    if outside.size:
        raise ValueError(
            f"{option} token {outside[0]} is not an id of the model's vocabulary (0 to {vocab_size - 1}); "
            "give ids in that range"
        )
    return ids


def sample_text(model: nnx.Module, tokenizer, prompt: str, tokens: int, **options) -> str:
    """The prompt followed by `tokens` generated ones, as text (token ids where there is no tokenizer)."""
    ids = prompt_ids(tokenizer, prompt, model.cfg.vocab_size)
    if tokenizer is None:
        return " ".join(map(str, [*ids.tolist(), *Generator(model).generate(ids, tokens, **options).tolist()]))
    return prompt + tokenizer.decode(Generator(model, tokenizer.vocab_size).generate(ids, tokens, **options))


def main(args) -> int:
    try:
        model, tokenizer, step = load_run(args.run_dir, args.data)
        if args.tokens < 1:
            raise ValueError(f"--tokens must be >= 1, got {args.tokens}")
        text = sample_text(
            model, tokenizer, args.prompt, args.tokens, temperature=args.temperature, top_k=args.top_k, seed=args.seed
        )
    except ValueError as e:
        print(f"jaxdist sample: error: {e}", file=sys.stderr)
        return 2
    print(f"[{args.run_dir}, step {step}]", file=sys.stderr)
    print(text)
    return 0
