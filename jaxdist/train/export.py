"""`jaxdist export RUN_DIR OUT`: a run's parameters as a plain orbax checkpoint of the model's pure dict.

OUT loads without jaxdist (orbax and Flax only; the README shows how) and is what `run.init_from`
reads. The model's config goes next to it in OUT/jaxdist_model.json. With `--format hf` (`export_hf`)
a Llama- or Gemma-style run is written as a Hugging Face directory instead (config.json, sharded
safetensors, the tokenizer), which `transformers` loads and `run.init_from=hf:OUT` reads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxdist.train import hf_init
from jaxdist.train.checkpoint import CheckpointError, Checkpoints
from jaxdist.train.model_record import PLATFORM_KEYS, model_record
from jaxdist.train.orbax_logs import DropOrbaxLogs
from jaxdist.train.report import disk_full, warn, write_problem

MODEL_FILE = "jaxdist_model.json"


def export(run_dir: str | Path, out: str | Path, step: int | None = None) -> tuple[int, Path]:
    """Write the parameters of checkpoint `step` (default: the newest readable) of `run_dir` to `out`."""
    out = Path(out).absolute()
    if out.exists():
        raise CheckpointError(f"{out} already exists; pick a new output path or remove it")
    step, meta, params = read_params(run_dir, step)
    record = json.dumps({"step": step, "model": exported_model(meta.get("model"))}, indent=1)
    quiet = DropOrbaxLogs()  # orbax logs a failed write with tracebacks: it is raised below, on one line
    quiet.attach()
    try:
        with ocp.StandardCheckpointer() as writer:
            writer.save(out, params)
        (out / MODEL_FILE).write_text(record)
    except (OSError, ValueError) as e:  # a full disk (tensorstore: ValueError RESOURCE_EXHAUSTED; OSError ENOSPC)
        for partial in (out, *out.parent.glob(f"{out.name}{ocp.path.atomicity_types.TMP_DIR_SUFFIX}*")):
            shutil.rmtree(partial, ignore_errors=True)  # no partial export left to be loaded by mistake
        hint = "free some space" if disk_full(e) else "fix the cause"
        problem = write_problem(e, out.parent)
        raise CheckpointError(f"could not write {out}: {problem}; {hint} and export again") from None
    finally:
        quiet.detach()
    return step, out


def exported_model(model):
    """A checkpoint's model record as `jaxdist.models.families.from_record` (for the GPT, `GPTConfig(**record)`)
    takes it: dtypes by name, its family named (but the GPT's), without the choices of the
    platform that trained it (flash attention on GPUs), which the loading platform makes again (a record that
    is not a config, as a hand-made checkpoint may hold, as it is)."""
    if not isinstance(model, dict):
        return model
    return {k: v for k, v in model_record(model).items() if k not in PLATFORM_KEYS}


def read_params(run_dir: str | Path, step: int | None = None) -> tuple[int, dict, dict]:
    """(step, metadata, parameters as host arrays) of checkpoint `step` of `run_dir` (default: the newest
    whose files verify against their checksums; each newer one is skipped with a warning and left in place).
    Raises a one-line CheckpointError when there is none."""
    step, (meta, params) = _newest_readable(run_dir, step, lambda ckpt, s: (ckpt.meta(s), ckpt.restore_params(s)))
    return step, meta, params


def _newest_readable(run_dir: str | Path, step: int | None, read) -> tuple[int, object]:
    """(step, read(ckpt, step)) of checkpoint `step` of `run_dir`, or of the newest that verifies and reads;
    a one-line CheckpointError saying why there is none."""
    if not (Path(run_dir) / "checkpoints").is_dir():  # checked first: opening one would create it
        raise CheckpointError(f"{Path(run_dir).absolute()} holds no checkpoints/; check the run directory")
    # read-only: the run may be training meanwhile, and reading must never move or delete a checkpoint
    ckpt = Checkpoints(run_dir, keep=1 << 30, read_only=True)
    try:
        steps = sorted(ckpt.manager.all_steps())
        found = ckpt.newest_readable(lambda s: read(ckpt, s), below=None if step is None else step + 1)
    finally:
        ckpt.close()
    if found is not None and (step is None or found[0] == step):
        return found
    if not steps:
        why = "no checkpoint yet (a run saves one every run.checkpoint_every steps and at its end)"
    elif step is not None and step not in steps:
        why = f"no checkpoint of step {step} (it has steps {', '.join(map(str, steps))})"
    else:
        which = "" if step is None else f" of step {step}"
        why = f"no readable checkpoint{which} (the warnings above say what is wrong with each)"
    raise CheckpointError(f"{ckpt.directory} holds {why}")


def load_params(path: str | Path, like: nnx.State) -> nnx.State:
    """The exported parameters at `path`, as host arrays in a copy of `like` (a model's `nnx.Param` state);
    a parameter missing, extra or of another shape raises a one-line error."""
    path = Path(path).absolute()
    if not path.is_dir():
        raise CheckpointError(f"run.init_from={path} is not a directory; pass the OUT of `jaxdist export`")
    pure = nnx.to_pure_dict(like)
    try:
        with ocp.PyTreeCheckpointer() as reader:
            saved = reader.metadata(path).item_metadata.tree
        _check_same_parameters(saved, pure)
        target = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), pure)
        with ocp.StandardCheckpointer() as reader:
            loaded = reader.restore(path, target)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise CheckpointError(
            f"run.init_from={path} does not hold this model's parameters ({first}); export a run of the same model"
        ) from None
    out = jax.tree.map(lambda x: x, like)
    nnx.replace_by_pure_dict(out, jax.tree.map(np.asarray, loaded))
    return out


def _check_same_parameters(saved, pure) -> None:
    """Raise naming the first parameter missing, extra or of another shape (orbax would pad or cut it)."""

    def flat(tree):
        return {
            "/".join(str(getattr(k, "key", k)) for k in kp): tuple(x.shape)
            for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]
        }

    have, want = flat(saved), flat(pure)
    for name in sorted(set(have) | set(want)):
        if name not in have:
            raise ValueError(f"{name} is missing")
        if name not in want:
            raise ValueError(f"{name} is not a parameter of the model")
        if have[name] != want[name]:
            raise ValueError(f"{name} has shape {have[name]}, the model's is {want[name]}")


def export_hf(
    run_dir: str | Path,
    out: str | Path,
    step: int | None = None,
    *,
    shard_bytes: int | None = None,
    dtype: str | None = None,
) -> tuple[int, Path]:
    """Write checkpoint `step` (default: the newest readable) of a Llama- or Gemma-style run as a Hugging
    Face directory `out` (`jaxdist.models.hf.save`): each parameter read from the checkpoint straight
    onto the local devices, sharded, then gathered and written one tensor at a time. The run's
    tokenizer (its data's tokenizer.json, and the companions of a run.init_from=hf:DIR) goes along."""
    from jaxdist.models import families, hf

    out = Path(out).absolute()
    if out.exists():
        raise CheckpointError(f"{out} already exists; pick a new output path or remove it")
    step, (meta, params) = _newest_readable(
        run_dir, step, lambda ckpt, s: (ckpt.meta(s), ckpt.restore_params_onto(s, _spread_over_devices))
    )
    record = meta.get("model") or {}
    if record.get("family") not in ("llama", "gemma"):
        raise CheckpointError(
            f"{run_dir} trained a {record.get('family', 'gpt')} model, which has no Hugging Face architecture; "
            "--format hf exports Llama- and Gemma-style runs (export it without --format)"
        )
    cfg = families.from_record(record)
    _warn_if_source_is_gone(meta, out)
    try:
        hf.save(
            out,
            params,
            record["family"],
            cfg,
            dtype=dtype,
            shard_bytes=shard_bytes or hf.DEFAULT_SHARD_BYTES,
            extra_files=_tokenizer_files(meta),
            source_config=_source_config(meta),
        )
    except OSError as e:
        hint = "free some space" if disk_full(e) else "fix the cause"
        problem = write_problem(e, out.parent)
        raise CheckpointError(f"could not write {out}: {problem}; {hint} and export again") from None
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    return step, out


def _spread_over_devices(shape: tuple[int, ...]) -> jax.sharding.Sharding:
    """Each parameter split along its first dimension the local devices divide (else kept whole on them)."""
    devices = jax.local_devices()
    mesh = jax.sharding.Mesh(np.asarray(devices), ("export",))
    spec = [None] * len(shape)
    for axis, n in enumerate(shape):
        if n % len(devices) == 0:
            spec[axis] = "export"
            break
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def _warn_if_source_is_gone(meta: dict, out: Path) -> None:
    source = hf_init.source_of(meta)
    if source is not None and not source.is_dir():
        warn(
            f"the run started from hf:{source}, which is not there (from {Path.cwd()}): its special token ids, "
            f"max_position_embeddings and tokenizer companions are not carried into {out}; export from the "
            "directory the run was started in, or where DIR is"
        )


def _source_config(meta: dict) -> dict | None:
    """The config.json of the run.init_from=hf:DIR the run fine-tuned, if that directory is still there."""
    from jaxdist.models import hf_config

    source = hf_init.source_of(meta)
    path = None if source is None else source / hf_config.CONFIG_FILE
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # the export does not need it: the run's own config describes the model


def _tokenizer_files(meta: dict) -> dict[str, Path]:
    """The tokenizer files to export: the companions in a run.init_from=hf:DIR, then the tokenizer.json of
    the data the run trained on (the one its tokens came from)."""
    from jaxdist.models import hf
    from jaxdist.train.data.tokenize import TOKENIZER_FILE

    files: dict[str, Path] = {}
    source = hf_init.source_of(meta)
    if source is not None and source.is_dir():
        files.update(hf.tokenizer_files(source))
    data_dir = (meta.get("data") or {}).get("dir")
    if data_dir and (Path(data_dir) / TOKENIZER_FILE).is_file():
        files[TOKENIZER_FILE] = Path(data_dir) / TOKENIZER_FILE
    return files
