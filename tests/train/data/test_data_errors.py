"""Bad data directories and `jaxdist prepare-data` destinations: one-line errors naming the fix, no traceback."""

import pytest

from jaxdist.train import config as config_lib
from jaxdist.train.cli import main
from jaxdist.train.config import ConfigError
from jaxdist.train.data.prepare import prepare
from jaxdist.train.data.sources import CORPUS
from jaxdist.train.trainer import train

BASE = ["model.flavor=tiny", "data.batch_size=8", "run.progress=false", "run.steps=1", "data.source=shards"]


@pytest.mark.parametrize("where", ["a file", "below a file"])
def test_prepare_data_into_a_file_is_a_one_line_error(tmp_path, capfd, where):
    blocker = tmp_path / "taken"
    blocker.write_text("not a directory")
    out = blocker if where == "a file" else blocker / "data"
    assert main(["prepare-data", str(CORPUS), "--out", str(out), "--quiet"]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxdist prepare-data: error: ")
    assert ("is a file; give the directory" if where == "a file" else "choose an --out you can write to") in err


@pytest.mark.parametrize("damage", ["missing", "cut mid-token"])
def test_a_damaged_shard_stops_training_on_one_line_naming_the_shard(tmp_path, damage):
    prepare([CORPUS], tmp_path / "d", shard_tokens=2000, progress=False)
    shard = tmp_path / "d" / "train-00001.bin"
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:-1])
    cfg = config_lib.load(None, [*BASE, f"data.path={tmp_path / 'd'}", f"run.out_dir={tmp_path / 'run'}"])
    with pytest.raises(
        ConfigError, match="shard .*train-00001.bin (is missing|has 3999 bytes), the index says 2000"
    ) as e:
        train(cfg)
    assert "\n" not in str(e.value) and str(e.value).endswith("prepare it again with jaxdist prepare-data")


def test_a_text_run_with_no_validation_text_names_the_config_key(tmp_path):
    over = ["data.source=text", "data.val_fraction=0.0", "run.eval_every=1", f"run.out_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match="the val split of .* has 0 tokens.*; raise data.val_fraction") as e:
        train(config_lib.load(None, [*BASE, *over]))
    assert "\n" not in str(e.value)


def test_text_prepared_on_the_fly_is_reused_after_the_text_file_moves(tmp_path, monkeypatch):
    from jaxdist.train.data import prepare as prepare_lib

    text = tmp_path / "a.txt"
    text.write_bytes(CORPUS.read_bytes())
    prepare_lib.ensure_prepared([text], tmp_path / "data", tokenizer="bytes", val_fraction=0.1, progress=False)
    moved = text.rename(tmp_path / "b.txt")

    def prepare_again(*args, **kwargs):
        raise AssertionError("the same text, moved, was tokenized again")

    monkeypatch.setattr(prepare_lib, "prepare", prepare_again)
    prepare_lib.ensure_prepared([moved], tmp_path / "data", tokenizer="bytes", val_fraction=0.1, progress=False)
    moved.write_bytes(CORPUS.read_bytes()[:-10])  # other text: prepared again
    with pytest.raises(AssertionError, match="tokenized again"):
        prepare_lib.ensure_prepared([moved], tmp_path / "data", tokenizer="bytes", val_fraction=0.1, progress=False)


def test_text_prepared_on_the_fly_is_prepared_again_when_its_tokenizer_file_is_replaced(tmp_path):
    """The tokenizer file is known by its content: a new file at the same path (another vocabulary) was
    silently ignored, the run training on the old tokenization."""
    import json

    from jaxdist.train.data import prepare as prepare_lib
    from jaxdist.train.data.tokenize import train_bpe

    text, tokenizer = CORPUS.read_text()[:20000], tmp_path / "tokenizer.json"
    train_bpe([text], 300).save(tokenizer)
    data = prepare_lib.ensure_prepared(
        [CORPUS], tmp_path / "data", tokenizer=str(tokenizer), val_fraction=0.1, progress=False
    )
    assert json.loads((data / "index.json").read_text())["vocab_size"] == 300
    train_bpe([text], 400).save(tokenizer)
    prepare_lib.ensure_prepared([CORPUS], data, tokenizer=str(tokenizer), val_fraction=0.1, progress=False)
    assert json.loads((data / "index.json").read_text())["vocab_size"] == 400


@pytest.mark.parametrize(
    "setting, match",
    [
        ("data.val_fraction=1.5", "data.val_fraction must be in \\[0, 1\\), got 1.5"),
        ("data.tokenizer=bpe:100", "data.tokenizer='bpe:100': write bpe:N with a vocabulary size N >= 258"),
    ],
)
def test_a_text_runs_bad_preparation_settings_are_named_as_config_keys(tmp_path, setting, match):
    with pytest.raises(ConfigError, match=match) as e:
        train(config_lib.load(None, [*BASE, "data.source=text", setting, f"run.out_dir={tmp_path}"]))
    assert "\n" not in str(e.value) and "--" not in str(e.value)  # not prepare-data's flags


def test_a_data_directory_without_a_validation_split_is_a_one_line_error(tmp_path):
    import json

    from jaxdist.train.data.shards import ShardData

    prepare([CORPUS], tmp_path / "d", progress=False)
    index = json.loads((tmp_path / "d" / "index.json").read_text())
    del index["splits"]["val"]  # as a directory written by another tool may be
    (tmp_path / "d" / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="has no val split; prepare the data with jaxdist prepare-data"):
        ShardData(tmp_path / "d", "val", seq_len=64, seed=0, stride=64, shuffle=False)


def test_a_damaged_index_stops_training_on_one_line_naming_it(tmp_path):
    prepare([CORPUS], tmp_path / "d", progress=False)
    index = tmp_path / "d" / "index.json"
    index.write_text(index.read_text()[:40])  # cut short
    cfg = config_lib.load(None, [*BASE, f"data.path={tmp_path / 'd'}", f"run.out_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="index.json is damaged .*; prepare the data again") as e:
        train(cfg)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("damage", ["{cut", "[]"])
def test_text_prepared_on_the_fly_with_a_damaged_index_is_prepared_again(tmp_path, damage):
    from jaxdist.train.data.prepare import ensure_prepared
    from jaxdist.train.data.shards import read_index

    ensure_prepared([CORPUS], tmp_path / "data", tokenizer="bytes", val_fraction=0.1, progress=False)
    (tmp_path / "data" / "index.json").write_text(damage)
    ensure_prepared([CORPUS], tmp_path / "data", tokenizer="bytes", val_fraction=0.1, progress=False)
    assert read_index(tmp_path / "data")["splits"]["train"]["tokens"] > 0


def test_a_run_directory_whose_data_folder_holds_the_users_files_is_refused_and_they_are_kept(tmp_path):
    """data.source=text prepares into <run.out_dir>/data: a run.out_dir pointed at a project folder had its
    data/ (the user's text and notes) deleted for the shards, or the run failed having deleted its input."""
    data = tmp_path / "project" / "data"
    data.mkdir(parents=True)
    (data / "corpus.txt").write_bytes(CORPUS.read_bytes())
    (data / "notes.md").write_text("mine")
    over = ["data.source=text", f"data.path={data / 'corpus.txt'}", f"run.out_dir={tmp_path / 'project'}"]
    with pytest.raises(ValueError, match="holds files jaxdist did not write \\(corpus.txt, notes.md\\)") as e:
        train(config_lib.load(None, [*BASE, *over, "run.steps=1"]))
    assert "choose another run.out_dir" in str(e.value) and "\n" not in str(e.value)
    assert sorted(p.name for p in data.iterdir()) == ["corpus.txt", "notes.md"]
    assert (data / "corpus.txt").read_bytes() == CORPUS.read_bytes()


def test_the_systems_hidden_files_in_a_prepared_data_folder_are_no_reason_to_refuse_it(tmp_path):
    from jaxdist.train.data import prepare as prepare_lib

    data = prepare_lib.ensure_prepared([CORPUS], tmp_path / "data", tokenizer="bytes", val_fraction=0.1, progress=False)
    for name in (".DS_Store", "._index.json", ".nfs000000000001"):  # macOS, SMB/exFAT, NFS leave these
        (data / name).write_bytes(b"\0")
    prepare_lib.ensure_prepared([CORPUS], data, tokenizer="bytes", val_fraction=0.2, progress=False)  # prepared again
