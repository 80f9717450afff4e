"""Hugging Face checkpoints in and out: a local `config.json` + `*.safetensors` directory, read straight
onto a target sharding and written tensor by tensor from a sharded state.

Reading (`load_params`) places each parameter with `jax.make_array_from_callback`: every device's
shard is read from the memory-mapped file through `safe_open(...).get_slice(name)` (the swapped
slice of a transposed weight), so no host or device ever holds the whole model, and each distinct
slice is read once. Before anything is read, every tensor's presence, shape and dtype is checked
against the config's layout (`jaxdist.models.hf_layout`), and the first mismatch is raised on one
line. Writing (`save`) gathers one tensor at a time onto the host and streams it into its shard
file (`model-0000k-of-0000n.safetensors`, at most `shard_bytes` each, with
`model.safetensors.index.json`), in the names and layouts `transformers` loads. Nothing is fetched
from a network.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import struct
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.core.runs import consecutive_runs
from jaxdist.models import families, hf_config
from jaxdist.models.hf_config import HFConfigError
from jaxdist.models.hf_layout import IGNORED_SUFFIXES, Tensor, tensors, tied

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
# config.json keys jaxdist does not model, kept from the checkpoint a fine-tuned model came from
CARRIED_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
DEFAULT_SHARD_BYTES = 5 * 10**9  # transformers' own default shard size
# safetensors dtype names of the floating-point tensors a checkpoint may store (cast to the model's dtype)
FLOAT_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16}
SAFETENSORS_NAMES = {np.dtype(v).name: k for k, v in FLOAT_DTYPES.items()}


class HFCheckpointError(ValueError):
    """A Hugging Face directory that does not hold this model's weights; the message is one line."""


@dataclasses.dataclass(frozen=True)
class HFModel:
    """What a Hugging Face directory's config.json says: the family, the jaxdist config, the architecture."""

    family: str  # "llama" or "gemma"
    config: Any  # LlamaConfig or GemmaConfig
    architecture: str


def family_classes(family: str) -> tuple[type, type]:
    """(model class, config class) of a family ("llama" or "gemma")."""
    if family not in ("llama", "gemma"):
        raise HFConfigError(f"unknown model family {family!r}; Hugging Face checkpoints are of llama or gemma")
    found = families.get(family)
    return found.model, found.config


def read_config(directory: str | Path, **overrides) -> HFModel:
    """The model of a Hugging Face directory's config.json, with `overrides` (e.g. seq_len, dtype,
    param_dtype, attention) replacing config fields."""
    raw = hf_config.load_json(directory)
    family, kwargs = hf_config.read(raw)
    _, config_cls = family_classes(family)
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(kwargs) - fields)
    if unknown == ["qk_norm"] and not kwargs["qk_norm"]:
        raise HFConfigError(f"{raw['architectures'][0]} (no q/k norms) is not supported by jaxdist's {family} model")
    if unknown:
        raise HFConfigError(f"jaxdist's {config_cls.__name__} has no field {unknown[0]}, which config.json sets")
    bad = sorted(set(overrides) - fields)
    if bad:
        raise HFConfigError(f"{config_cls.__name__} has no field {bad[0]}; valid fields: {', '.join(sorted(fields))}")
    return HFModel(family, config_cls(**{**kwargs, **overrides}), raw["architectures"][0])


def weight_files(directory: str | Path) -> dict[str, Path]:
    """Each tensor's file: from model.safetensors.index.json (sharded) or model.safetensors."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise HFCheckpointError(f"{index} is not a safetensors index (a JSON object with a weight_map)") from None
        files = {name: directory / file for name, file in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise HFCheckpointError(f"{path.name}, named by {INDEX_FILE}, is missing from {directory.absolute()}")
        return files
    single = directory / SINGLE_FILE
    if single.is_file():
        from safetensors import safe_open

        with safe_open(single, "numpy") as f:
            return dict.fromkeys(f.keys(), single)
    raise HFCheckpointError(
        f"{directory.absolute()} has no {SINGLE_FILE} or {INDEX_FILE}; give a directory of safetensors weights"
    )


class SafetensorsReader:
    """The tensors of a checkpoint directory, opened memory-mapped; `read` returns one slice."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.files = weight_files(directory)
        self._stack = contextlib.ExitStack()
        self._open: dict[Path, Any] = {}

    def _file(self, name: str):
        from safetensors import safe_open

        path = self.files[name]
        if path not in self._open:
            self._open[path] = self._stack.enter_context(safe_open(path, "numpy"))
        return self._open[path]

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype name) of a tensor, from its file's header."""
        piece = self._file(name).get_slice(name)
        return tuple(piece.get_shape()), piece.get_dtype()

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The slice `index` of tensor `name` (only those bytes are read from the mapped file)."""
        return self._file(name).get_slice(name)[index]

    def close(self) -> None:
        self._stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def check_checkpoint(reader: SafetensorsReader, layout: list[Tensor], skip_tied_head: bool) -> None:
    """Raise naming the first missing, unexpected, misshapen or non-float tensor."""
    where = reader.directory.absolute()
    names = {t.name for t in layout}
    for t in layout:
        if t.name not in reader.files:
            raise HFCheckpointError(f"missing tensor {t.name} (jaxdist's {t.path}) in {where}")
    for name in reader.files:
        if name in names or name.endswith(IGNORED_SUFFIXES) or (skip_tied_head and name == "lm_head.weight"):
            continue
        raise HFCheckpointError(f"unexpected tensor {name} in {where}: config.json's model has no such parameter")
    for t in layout:
        shape, dtype = reader.info(t.name)
        if shape != t.hf_shape:
            raise HFCheckpointError(
                f"tensor {t.name} has shape {list(shape)} in {where}, config.json says {list(t.hf_shape)}"
            )
        if dtype not in FLOAT_DTYPES:
            raise HFCheckpointError(
                f"tensor {t.name} is stored as {dtype} in {where}; jaxdist reads {', '.join(FLOAT_DTYPES)} tensors"
            )


def flat_paths(tree) -> dict[str, Any]:
    """A pure-dict tree's leaves by '/'-joined path."""
    return {
        "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in kp): leaf
        for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def check_target(layout: list[Tensor], target: dict[str, Any]) -> None:
    """Raise if the model's parameters are not the layout's (another config, or a model that deviates)."""
    want = {t.path: t for t in layout}
    for path, leaf in target.items():
        if path not in want:
            raise HFCheckpointError(f"the model's parameter {path} has no Hugging Face tensor in this family's layout")
        if tuple(leaf.shape) != want[path].shape:
            raise HFCheckpointError(
                f"the model's parameter {path} is {list(leaf.shape)}, config.json makes it {list(want[path].shape)}"
            )
    for path in want:
        if path not in target:
            raise HFCheckpointError(f"the model has no parameter {path}, which config.json's layout has")


def _array(reader: SafetensorsReader, t: Tensor, target) -> jax.Array:
    """One parameter onto `target.sharding`, each device's shard read as its own slice (once per slice)."""
    read: dict[tuple, np.ndarray] = {}

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        index = tuple(slice(*s.indices(n)) for s, n in zip(index, t.shape, strict=True))
        key = tuple((s.start, s.stop) for s in index)
        if key not in read:
            if t.transpose:  # the swapped slice of the (out, in) weight, then its transpose
                data = np.ascontiguousarray(reader.read(t.name, index[::-1]).T)
            else:
                data = reader.read(t.name, index)
            read[key] = np.asarray(data).astype(target.dtype, copy=False)
        return read[key]

    return jax.make_array_from_callback(t.shape, target.sharding, shard, dtype=target.dtype)


def load_params(directory: str | Path, model: HFModel, target) -> Any:
    """The weights of a Hugging Face directory as the model's parameter tree (a pure dict), placed on
    `target`: a tree like the model's pure-dict parameters of `jax.ShapeDtypeStruct`s that carry a
    sharding (e.g. a run's `canonical_target().params`), or of shardings (dtype: the model's param_dtype).
    Raises HFCheckpointError naming the first tensor that is missing, unexpected, of another shape or
    of a non-float dtype, before any weight is read."""
    layout = tensors(model.family, model.config)
    by_path = {t.path: t for t in layout}
    param_dtype = getattr(model.config, "param_dtype", jnp.float32)
    flat = flat_paths(target)
    for path in flat:
        if path not in by_path:
            raise HFCheckpointError(f"the model's parameter {path} has no Hugging Face tensor in this family's layout")
    structs = {
        p: jax.ShapeDtypeStruct(by_path[p].shape, param_dtype, sharding=x)
        if isinstance(x, jax.sharding.Sharding)
        else x
        for p, x in flat.items()
    }
    check_target(layout, structs)
    with SafetensorsReader(directory) as reader:
        check_checkpoint(reader, layout, skip_tied_head=tied(model.family, model.config))
        loaded = [_array(reader, by_path[p], x) for p, x in structs.items()]
    return jax.tree.unflatten(jax.tree.structure(target), loaded)


def _host_value(x) -> np.ndarray:
    """One parameter's whole value on this host (gathered across processes where it is not all here)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


# the short names people also write (torch's spellings)
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def _storage_dtype(dtype) -> np.dtype:
    """The dtype tensors are written in: float32, bfloat16 or float16 (or an alias of one)."""
    choose = "choose float32, bfloat16 or float16"
    try:
        resolved = np.dtype(DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else dtype)
    except TypeError:
        raise HFCheckpointError(f"cannot store tensors as {dtype!r}: not a dtype; {choose}") from None
    if resolved.name not in SAFETENSORS_NAMES:
        raise HFCheckpointError(f"cannot store tensors as {resolved.name}; {choose}")
    return resolved


def _header(group: list[Tensor], dtype: np.dtype) -> bytes:
    """A safetensors header for `group` stored contiguously in order, padded to 8 bytes as the format asks."""
    entries, offset = {}, 0
    for t in group:
        n = int(np.prod(t.shape)) * dtype.itemsize
        entries[t.name] = {
            "dtype": SAFETENSORS_NAMES[dtype.name],
            "shape": list(t.hf_shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    text = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _write_file(path: Path | None, group: list[Tensor], params: dict[str, Any], dtype: np.dtype) -> None:
    """Stream `group`'s tensors into one safetensors file, gathering one tensor at a time (every process
    takes part in each gather; `path` is None on those that do not write)."""
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(path, "wb")) if path is not None else None
        if out is not None:
            out.write(_header(group, dtype))
        for t in group:
            value = _host_value(params[t.path])
            if out is not None:
                value = value.T if t.transpose else value
                out.write(np.ascontiguousarray(value.astype(dtype, copy=False)).tobytes())
            del value


def save(
    out: str | Path,
    params,
    family: str,
    cfg,
    *,
    dtype=None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    extra_files: dict[str, Path] | None = None,
    source_config: dict | None = None,
) -> Path:
    """Write `params` (the model's pure-dict parameters, sharded arrays; a run's `canonical(state).params`)
    as a Hugging Face directory `out`: config.json, the safetensors files (in `dtype`, default the
    parameters'), the index when there is more than one, and `extra_files` (name -> file to copy, e.g.
    the tokenizer). `source_config`, the config.json a fine-tuned model came from, gives the keys jaxdist
    does not model (`CARRIED_KEYS`: its token ids and context length) when it is of the same family.
    Written to a temporary sibling and renamed, so a failed write leaves no `out`."""
    out = Path(out).absolute()
    if out.exists():
        raise HFCheckpointError(f"{out} already exists; pick a new output path or remove it")
    if shard_bytes < 1:
        raise HFCheckpointError(f"shard_bytes must be >= 1, got {shard_bytes}")
    layout = tensors(family, cfg)
    flat = flat_paths(params)
    check_target(layout, flat)
    dtype = _storage_dtype(dtype or next(iter(flat.values())).dtype)
    config = carry_keys(hf_config.write(family, cfg, hf_config.torch_dtype_name(dtype)), source_config)
    # tensors in order, files of at most shard_bytes (a larger tensor alone in its own)
    files = consecutive_runs(layout, [int(np.prod(t.shape)) * dtype.itemsize for t in layout], shard_bytes)
    names = (
        [SINGLE_FILE]
        if len(files) == 1
        else [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))]
    )
    writer = jax.process_index() == 0
    tmp = out.with_name(f".{out.name}.partial")
    if writer:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    try:
        for name, group in zip(names, files, strict=True):
            _write_file(tmp / name if writer else None, group, flat, dtype)
        if writer:
            if len(files) > 1:
                total = sum(int(np.prod(t.shape)) * dtype.itemsize for t in layout)
                weight_map = {t.name: name for name, group in zip(names, files, strict=True) for t in group}
                index = {"metadata": {"total_size": total}, "weight_map": weight_map}
                (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
            (tmp / hf_config.CONFIG_FILE).write_text(json.dumps(config, indent=2))
            for name, source in (extra_files or {}).items():
                shutil.copyfile(source, tmp / name)
            tmp.rename(out)
    except BaseException:
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _family_of_architectures(config: dict) -> str | None:
    names = config.get("architectures") or []
    if len(names) != 1:
        return None
    if names[0] in hf_config.LLAMA_ARCHITECTURES:
        return "llama"
    return "gemma" if names[0] in hf_config.GEMMA_ARCHITECTURES else None


def carry_keys(config: dict, source: dict | None) -> dict:
    """`config` with the `CARRIED_KEYS` of `source` (a config.json of the same family, e.g. a Mistral without
    a window written back as a Llama): the special token ids generation needs, and the longer of the two
    context lengths (a model fine-tuned on shorter sequences keeps the length its RoPE was made for)."""
    family = _family_of_architectures(config)
    if not source or family is None or _family_of_architectures(source) != family:
        return config
    out = dict(config)
    for key in CARRIED_KEYS:
        if source.get(key) is not None:
            out[key] = source[key]
    if isinstance(source.get("max_position_embeddings"), int):
        out["max_position_embeddings"] = max(source["max_position_embeddings"], config["max_position_embeddings"])
    return out


def tokenizer_files(directory: str | Path) -> dict[str, Path]:
    """The tokenizer files a Hugging Face directory holds (tokenizer.json and its companions)."""
    return {n: Path(directory) / n for n in TOKENIZER_FILES if (Path(directory) / n).is_file()}


def abstract_model(model: HFModel):
    """(graphdef, abstract parameters, the other variables built for real) of `model`, no weights made."""
    from flax import nnx

    model_cls, _ = family_classes(model.family)

    def build():
        return model_cls(model.config, nnx.Rngs(0))

    graphdef, params, rest = nnx.split(nnx.eval_shape(build), nnx.Param, ...)

    def others():
        return nnx.state(build(), nnx.Not(nnx.Param))

    return graphdef, params, jax.jit(others)() if jax.tree.leaves(rest) else rest


def load_model(directory: str | Path, sharding: jax.sharding.Sharding | None = None, **overrides):
    """The Flax NNX model of a Hugging Face directory, its weights placed on `sharding` (default: the
    first device). `overrides` replace config fields (seq_len, dtype, param_dtype, attention, ...).

        model = load_model("path/to/Qwen3-0.6B", dtype=jnp.bfloat16)
        logits = model(tokens)
    """
    from flax import nnx

    hf = read_config(directory, **overrides)
    graphdef, params, rest = abstract_model(hf)
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    pure = nnx.to_pure_dict(params)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), pure)
    nnx.replace_by_pure_dict(params, load_params(directory, hf, target))
    return nnx.merge(graphdef, params, rest)
