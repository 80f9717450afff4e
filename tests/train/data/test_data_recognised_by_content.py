"""A checkpoint recognises its data by content, not by where it lies: the same shards copied or moved
are the same data (a whole run resumed on moved data: tests/train/data/test_data_stream_resume.py);
other data of the same size, or another seed, is still reported."""

import shutil

import pytest

from jaxdist.train.data.prepare import prepare
from jaxdist.train.data.shards import ShardData
from jaxdist.train.data.sources import CORPUS
from jaxdist.train.hooks import check_same_data


def _data(directory):
    return ShardData(directory, "train", seq_len=32, seed=0, stride=32, shuffle=True)


@pytest.fixture
def prepared(tmp_path):
    prepare([CORPUS], tmp_path / "d", shard_tokens=5000, progress=False)
    return tmp_path / "d"


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
