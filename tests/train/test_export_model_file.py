"""`jaxdist export`'s `jaxdist_model.json` names dtypes so `GPTConfig(**record)` builds the model, and the
loading snippet of the trainer's docs page (docs/trainer.md) runs as written against a real export (with the
relative path it shows)."""

import json
import re
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdist.models.gpt import FLAVORS, GPT, GPTConfig
from jaxdist.train import config as config_lib
from jaxdist.train.array_files import read_tree
from jaxdist.train.cli import main
from jaxdist.train.model_record import check_same_model
from jaxdist.train.trainer import train

PAGE = Path(__file__).resolve().parents[2] / "docs" / "trainer.md"
RUN = ["model.flavor=tiny", "data.source=synthetic", "data.batch_size=8", "run.steps=1", "run.progress=false"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A 1-step run in runs/tiny exported to runs/tiny.params, under a fresh working directory."""
    root = tmp_path_factory.mktemp("work")
    train(config_lib.load(None, [*RUN, f"run.out_dir={root / 'runs' / 'tiny'}"]))
    assert main(["export", str(root / "runs" / "tiny"), str(root / "runs" / "tiny.params")]) == 0
    return root


def _saved_params(run_dir: Path) -> dict:
    """The parameters of the run's checkpoint of step 1, read from its array files as host arrays (a run's
    checkpoint records no shardings: a reader names where the arrays go, here NumPy)."""
    return read_tree(run_dir / "checkpoints" / "1" / "arrays", "params")


@pytest.mark.filterwarnings("ignore:Sharding info not provided")
def test_the_model_file_names_dtypes_and_builds_the_trained_model(exported):
    record = json.loads((exported / "runs" / "tiny.params" / "jaxdist_model.json").read_text())
    assert record["step"] == 1
    model = record["model"]
    assert model["dtype"] == "float32" and model["param_dtype"] == "float32"
    assert "attention" not in model  # the loading platform picks its own attention
    cfg = GPTConfig(**model)
    tiny = FLAVORS["tiny"]
    for field in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "tie_embeddings"):
        assert getattr(cfg, field) == getattr(tiny, field)
    assert jnp.dtype(cfg.dtype) == jnp.float32 and jnp.dtype(cfg.param_dtype) == jnp.float32
    built = nnx.state(GPT(cfg, nnx.Rngs(0)), nnx.Param)
    saved = _saved_params(exported / "runs" / "tiny")
    assert {k: v.shape for k, v in _by_path(nnx.to_pure_dict(built)).items()} == {
        k: v.shape for k, v in _by_path(saved).items()
    }


def _loading_snippet() -> str:
    text = PAGE.read_text()
    section = text[text.index("## Export and import") :]
    return textwrap.dedent(re.search(r"```python\n(.*?)```", section, re.S).group(1))


def _by_path(tree) -> dict:
    """Leaves by their path, list indices and string keys alike ("0"): orbax reads list keys back as strings."""
    return {_name(path): np.asarray(v) for path, v in jax.tree_util.tree_leaves_with_path(tree)}


def _name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


@pytest.mark.filterwarnings("ignore:Sharding info not provided")
def test_the_docs_loading_snippet_runs_as_written_against_an_export(exported, monkeypatch):
    snippet = _loading_snippet()
    assert 'Path("runs/tiny.params")' in snippet  # the path the export command above it writes, relative
    monkeypatch.chdir(exported)
    scope: dict = {}
    exec(compile(snippet, str(PAGE), "exec"), scope)
    loaded = nnx.to_pure_dict(nnx.state(scope["model"], nnx.Param))
    saved = _saved_params(exported / "runs" / "tiny")
    loaded, saved = _by_path(loaded), _by_path(saved)
    assert loaded.keys() == saved.keys()
    for name, value in saved.items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)
    logits = scope["model"](jnp.zeros((1, FLAVORS["tiny"].seq_len), jnp.int32))
    assert logits.shape == (1, FLAVORS["tiny"].seq_len, FLAVORS["tiny"].vocab_size)


def test_a_checkpoint_recorded_with_scalar_type_text_is_the_same_model():
    """Checkpoints of an older jaxdist recorded `str(jnp.float32)`: they still resume."""
    old = {"d_model": 64, "dtype": "float32", "param_dtype": "<class 'jax.numpy.float32'>", "attention": None}
    new = {"d_model": 64, "dtype": "float32", "param_dtype": "float32", "attention": None}
    check_same_model({"model": old}, new, Path("."))
    with pytest.raises(config_lib.ConfigError, match="for another model"):
        check_same_model({"model": {**old, "param_dtype": "<class 'jax.numpy.bfloat16'>"}}, new, Path("."))
