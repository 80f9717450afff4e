"""A config file's run directory defaults to runs/<its name>, so the quick start and the data page's
commands run one after another; a run directory holding another model's checkpoint is refused naming each
setting that differs."""

import shlex
import shutil
from pathlib import Path

import pytest

from jaxdist.train import cli
from jaxdist.train import config as config_lib
from jaxdist.train.config import ConfigError
from jaxdist.train.trainer import train

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "jaxdist/train/configs/tiny.toml"
# small and short: what is checked is where each command reads and writes, not the training. The tiny
# flavor's sizes (tiny.toml's are larger) and 8 rows: the program of the other short tiny runs (e.g.
# tests/train/test_metrics_rows.py), compiled once per test run
CHEAP = [
    "run.steps=1",
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=4",
    "parallel.tp=1",
    "data.batch_size=8",
    "run.eval_every=0",
    "run.sample_tokens=0",
    "run.progress=false",
]


def test_out_dir_defaults_to_the_config_files_name(tmp_path):
    assert config_lib.load(TINY).run.out_dir == "runs/tiny"  # the quick start's documented directory
    other = tmp_path / "books.toml"
    other.write_text("[model]\nvocab_size = 512\n")
    assert config_lib.load(other).run.out_dir == "runs/books"
    assert config_lib.load(other, ["run.out_dir=elsewhere"]).run.out_dir == "elsewhere"
    other.write_text('[run]\nout_dir = "mine"\n')
    assert config_lib.load(other).run.out_dir == "mine"
    assert config_lib.load(None).run.out_dir == "runs/default"


def docs_commands(page: str) -> list[list[str]]:
    """The `jaxdist` commands of the first bash block of the documentation page `page`."""
    body = (REPO / "docs" / page).read_text()
    block = body.split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def test_the_data_pages_example_runs_after_the_quick_start(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "books").mkdir()
    shutil.copy(REPO / "jaxdist/train/data/corpus/river.txt", tmp_path / "books" / "river.txt")
    assert cli.main(["train", str(TINY), *CHEAP]) == 0  # the quick start: runs/tiny, bytes
    commands = docs_commands("data.md")
    assert [c[:2] for c in commands] == [["jaxdist", "prepare-data"], ["jaxdist", "train"], ["jaxdist", "sample"]]
    for command in commands:
        args = [str(TINY) if a == "jaxdist/train/configs/tiny.toml" else a for a in command[1:]]
        args = [str(tmp_path / "books" / "river.txt") if a == "books/*.txt" else a for a in args]
        if args[0] == "train":
            args += CHEAP
        if args[0] == "sample":
            args[args.index("--tokens") + 1] = "3"
        assert cli.main(args) == 0, f"{shlex.join(command)}: {capsys.readouterr().err[-2000:]}"
    assert (tmp_path / "runs" / "tiny" / "checkpoints").is_dir()


def test_another_models_checkpoint_names_each_difference_on_one_line(tmp_path):
    out = tmp_path / "run"
    small = ["data.source=synthetic", *CHEAP, f"run.out_dir={out}"]
    train(config_lib.load(None, [*small, "model.vocab_size=256"]))
    with pytest.raises(ConfigError) as e:
        train(config_lib.load(None, [*small, "model.vocab_size=512", "model.n_layers=3"]))
    message = str(e.value)
    assert "\n" not in message
    assert f"the checkpoint in {out / 'checkpoints'} is for another model (saved vs now: " in message
    assert "model.n_layers 2 vs 3, model.vocab_size 256 vs 512)" in message
    assert "d_model" not in message  # only what differs, not the whole saved config
    assert "run.out_dir" in message and "run.overwrite=true" in message
