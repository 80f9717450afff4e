"""A checkpoint recognises its data by content, not by where it lies: the same shards moved to another
directory resume without a "data changed" warning (and `jaxdist sample --data` finds the moved tokenizer);
other data of the same size is still reported."""

import shutil

import pytest

from jaxdist.train import config as config_lib
from jaxdist.train.data import CORPUS
from jaxdist.train.hooks import check_same_data
from jaxdist.train.prepare import prepare
from jaxdist.train.sample import load_run
from jaxdist.train.shards import ShardData
from jaxdist.train.trainer import train

BASE = ["model.flavor=tiny", "data.batch_size=8", "run.log_every=1", "run.progress=false", "run.steps=2"]


def _data(directory):
    return ShardData(directory, "train", seq_len=32, seed=0, stride=32, shuffle=True)


@pytest.fixture
def prepared(tmp_path):
    prepare([CORPUS], tmp_path / "d", shard_tokens=5000, progress=False)
    return tmp_path / "d"


def test_moving_the_data_and_resuming_gives_no_data_changed_warning(prepared, tmp_path, capfd):
    out = tmp_path / "run"
    over = ["data.source=shards", f"run.out_dir={out}"]
    first = train(config_lib.load(None, [*BASE, *over, f"data.path={prepared}"]), stop_after=1)
    moved = shutil.move(prepared, tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=f"data directory {prepared} the run trained on .* is gone; give where"):
        load_run(out)  # `jaxdist sample` needs the data's tokenizer: it says how to point at the moved data
    assert load_run(out, moved)[1].vocab_size == 256
    capfd.readouterr()
    resumed = train(config_lib.load(None, [*BASE, *over, f"data.path={moved}"]))
    said = "".join(capfd.readouterr())
    assert len(first) == len(resumed) == 1
    assert "resumed from" in said and "data changed" not in said


def test_other_data_of_the_same_size_is_reported_by_content(prepared, tmp_path, capfd):
    saved = {"data": _data(prepared).state()}
    text = CORPUS.read_bytes()
    other = tmp_path / "other.txt"
    other.write_bytes(text.replace(b"e", b"a"))  # same bytes count, other text: same rows and tokens
    prepare([other], tmp_path / "o", shard_tokens=5000, progress=False)
    assert _data(tmp_path / "o").state()["tokens"] == saved["data"]["tokens"]
    check_same_data(saved, _data(tmp_path / "o"))
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "the data changed since the checkpoint (content: " in err


def test_the_same_data_copied_or_moved_is_the_same_and_so_is_an_older_checkpoints_record(prepared, tmp_path, capfd):
    saved = _data(prepared).state()
    copy = shutil.copytree(prepared, tmp_path / "copy")
    check_same_data({"data": saved}, _data(copy))
    older = {k: saved[k] for k in ("dir", "rows", "tokens")}  # what a checkpoint of an older jaxdist records
    check_same_data({"data": older}, _data(copy))
    assert "".join(capfd.readouterr()) == ""
    check_same_data({"data": {"source": "SyntheticData"}}, _data(copy))  # another kind of data altogether
    assert "the data changed" in capfd.readouterr().err


def test_another_seed_is_other_batches_and_is_reported(prepared, capfd):
    saved = _data(prepared).state()
    check_same_data({"data": saved}, ShardData(prepared, "train", seq_len=32, seed=1, stride=32, shuffle=True))
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "the data changed since the checkpoint (seed: 0 -> 1)" in err
