"""`run.init_from=hf:DIR` trains a Hugging Face checkpoint and `jaxdist export --format hf` writes it back.

The fine-tuning page (docs/finetune-hf.md) runs as written, in order, on the tiny checkpoint its first
block writes (the training shortened to 2 steps, the sample to 3 tokens). A run started from a
checkpoint whose first step has learning rate 0 (the warmup's) exports exactly the tensors it was
started from (a Qwen 3 under FSDP x TP, a Gemma 3 under FSDP): loading onto the strategy's layout and
exporting from it lose nothing and move nothing. The run's model and tokenizer come from the
directory; model keys that contradict config.json are refused naming both values."""

import importlib.util
import json
import os
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from support import hf_configs, hf_reference

from jaxdist.models import hf
from jaxdist.train import cli
from jaxdist.train import config as config_lib
from jaxdist.train.checkpoint import CheckpointError
from jaxdist.train.config import ConfigError
from jaxdist.train.export import export_hf
from jaxdist.train.trainer import train

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "finetune-hf.md"
BLOCK = re.compile(
    r"^<!-- snippet: run by tests/train/test_hf_finetune.py([^>]*)-->\n```(python|bash)\n(.*?)^```", re.S | re.M
)
SHORT = ["run.steps=2", "data.batch_size=8", "run.progress=false", "run.eval_every=0", "run.sample_tokens=0"]


def page_blocks() -> list[tuple[str, str, str]]:
    return BLOCK.findall(PAGE.read_text())


def run_command(line: str) -> None:
    args = shlex.split(line)[1:]
    args = [str(REPO / a) if a.startswith("jaxdist/train/data/corpus/") else a for a in args]
    if args[0] == "train":
        args = [a for a in args if not a.startswith("run.steps=")] + SHORT
    if args[0] == "sample":
        args[args.index("--tokens") + 1] = "3"
    assert cli.main(args) == 0, line


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """The page's blocks run in order in a fresh working directory."""
    root = tmp_path_factory.mktemp("page")
    here = os.getcwd()
    os.chdir(root)
    try:
        for note, language, code in page_blocks():
            if language == "bash":
                for line in filter(str.strip, code.splitlines()):
                    run_command(line)
            elif "transformers" not in note or importlib.util.find_spec("transformers"):
                exec(compile(code, str(PAGE), "exec"), {"__name__": "finetune_page"})
    finally:
        os.chdir(here)
    return root


def test_the_page_has_its_blocks():
    kinds = [language for _, language, _ in page_blocks()]
    assert kinds == ["python", "bash", "python", "python"]


def test_the_fine_tuning_page_runs_end_to_end(page):
    out = page / "qwen3-ft"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["hidden_size"] == 64
    assert (out / "model.safetensors").is_file()
    assert (out / "tokenizer.json").read_bytes() == (page / "tiny-qwen3" / "tokenizer.json").read_bytes()
    index = json.loads((page / "river-data" / "index.json").read_text())
    assert index["vocab_size"] == 300 and "tiny-qwen3" in index["tokenizer_source"]
    trained = load_file(out / "model.safetensors")
    start = load_file(page / "tiny-qwen3" / "model.safetensors")
    assert trained.keys() == start.keys()
    assert any(not np.array_equal(trained[k], start[k]) for k in start)  # it did train


def exported_after_one_step(start: Path, tmp_path: Path, layout: list[str], monkeypatch) -> tuple[dict, dict]:
    """(tensors written by exporting a one-step run from `start`, bytes of each slice read at its start)."""
    reads: dict[str, list[int]] = {}
    read = hf.SafetensorsReader.read

    def counted(reader, name, index):
        data = read(reader, name, index)
        reads.setdefault(name, []).append(data.nbytes)
        return data

    monkeypatch.setattr(hf.SafetensorsReader, "read", counted)
    run = tmp_path / "run"
    # one step: the warmup's first learning rate is 0, so nothing changes
    train(config_lib.load(None, [f"run.init_from=hf:{start}", *layout, f"run.out_dir={run}", *SHORT, "run.steps=1"]))
    export_hf(run, tmp_path / "out", shard_bytes=20_000)
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1
    written = {}
    for file in (tmp_path / "out").glob("*.safetensors"):
        written.update(load_file(file))
    return written, reads


def test_a_first_step_of_learning_rate_0_exports_the_weights_it_started_from(page, tmp_path, monkeypatch):
    start = page / "tiny-qwen3"
    written, reads = exported_after_one_step(start, tmp_path, ["parallel.fsdp=2", "parallel.tp=2"], monkeypatch)
    original = load_file(start / "model.safetensors")
    assert written.keys() == original.keys()
    for name, value in original.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)
    # onto the canonical shardings: the fsdp x tp split weights are read in quarters, never whole
    for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight"):
        assert max(reads[name]) == original[name].nbytes // 4, (name, reads[name])
    assert sum(max(r) for r in reads.values()) < sum(w.nbytes for w in original.values()) / 2
    index = json.loads((tmp_path / "run" / "data" / "index.json").read_text())
    assert index["tokenizer_source"] == str(start / "tokenizer.json")  # data.source=text took the model's tokenizer


def test_an_export_from_another_directory_carries_what_the_relative_hf_directory_gives(page, tmp_path, monkeypatch):
    """The page trains from run.init_from=hf:tiny-qwen3, relative to its directory: the run keeps it absolute, so
    an export from elsewhere still carries the source's max_position_embeddings (128, the run's is 64)."""
    monkeypatch.chdir(tmp_path)
    export_hf(page / "runs" / "qwen3-ft", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["max_position_embeddings"] == 128


def test_an_export_whose_hf_directory_is_gone_says_what_it_cannot_carry(tmp_path, capsys):
    from jaxdist.train.export import _warn_if_source_is_gone

    meta = {"config": {"run": {"init_from": "hf:tiny-qwen3"}}}  # a run of before 2026-12-05, elsewhere
    _warn_if_source_is_gone(meta, tmp_path / "out")
    said = capsys.readouterr().err
    assert "the run started from hf:tiny-qwen3, which is not there" in said and "max_position_embeddings" in said


# with the slow tests: the fast run round-trips a Hugging Face checkpoint through training in the fine-tuning
# page's test above, and trains a Gemma through the trainer in tests/train/test_model_families.py
@pytest.mark.slow
def test_a_gemma3_checkpoint_round_trips_through_fsdp_training(tmp_path, monkeypatch):
    # keys jaxdist does not model: generation's token ids and the context the RoPE was made for
    source = {**hf_configs.GEMMA3, "bos_token_id": 2, "eos_token_id": [1, 106], "max_position_embeddings": 4096}
    start = hf_reference.write_checkpoint(tmp_path / "gemma3", source, hf_reference.random_weights(source))
    # model.seq_len: a run takes the checkpoint's context (4096 here) unless told; 32 tokens train as well, and
    # the export keeps the checkpoint's longer max_position_embeddings (checked below)
    layout = ["parallel.fsdp=4", "data.source=synthetic", "model.seq_len=32"]
    written, _ = exported_after_one_step(start, tmp_path, layout, monkeypatch)
    original = load_file(start / "model.safetensors")
    assert written.keys() == original.keys()
    for name, value in original.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["max_position_embeddings"]) == (2, [1, 106], 4096)
    assert hf.hf_config.read(config) == hf.hf_config.read(source)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.d_model=48", "model.d_model=48 contradicts hidden_size=64 in "),
        ("model.tie_embeddings=false", "model.tie_embeddings=False contradicts tie_word_embeddings=True in "),
        ("model.seq_len=1000", "model.seq_len=1000 is longer than max_position_embeddings=128 in "),
    ],
)
def test_model_keys_that_contradict_config_json_are_refused_naming_both(page, tmp_path, override, message):
    cfg = config_lib.load(None, [f"run.init_from=hf:{page / 'tiny-qwen3'}", override, f"run.out_dir={tmp_path}"])
    with pytest.raises(ConfigError) as e:
        train(cfg)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_directory_without_config_json_is_refused(tmp_path):
    cfg = config_lib.load(None, [f"run.init_from=hf:{tmp_path}", f"run.out_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="has no config.json; give a Hugging Face model directory"):
        train(cfg)


@pytest.mark.slow  # a trainer run for one refusal
def test_a_gpt_run_has_no_hugging_face_export(tmp_path):
    run = tmp_path / "gpt"
    # the tiny GPT, one step of 8 rows: the program of the other batch-8 tiny runs (test_metrics_rows.py)
    train(config_lib.load(None, ["data.source=synthetic", f"run.out_dir={run}", *SHORT, "run.steps=1"]))
    with pytest.raises(CheckpointError, match="trained a gpt model, which has no Hugging Face architecture"):
        export_hf(run, tmp_path / "out")


@pytest.mark.parametrize(("text", "size"), [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2**31), ("4096", 4096)])
def test_shard_sizes_read_as_transformers_writes_them(text, size):
    assert cli._byte_size(text) == size


def test_a_shard_size_that_is_no_size_is_refused():
    with pytest.raises(CheckpointError, match="--shard-size 'big' is not a size"):
        cli._byte_size("big")


def test_sample_decodes_a_run_without_a_data_tokenizer_with_the_checkpoints(page):
    from jaxdist.train.sample import _init_tokenizer

    meta = {"config": {"run": {"init_from": f"hf:{page / 'tiny-qwen3'}"}}}
    assert _init_tokenizer(meta).vocab_size == 300
    assert _init_tokenizer({"config": {"run": {"init_from": ""}}}) is None
