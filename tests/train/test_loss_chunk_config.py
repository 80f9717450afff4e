"""`model.loss_chunk` reaches the GPT's config; where the TP plan's vocabulary-parallel loss (or the
pipeline) computes the loss, it is refused on one line rather than run untested."""

import pytest

from jaxdist.train import config as config_lib
from jaxdist.train import trainer
from jaxdist.train.config import ConfigError


def test_loss_chunk_reaches_the_model_config():
    c = config_lib.load(None, ["model.flavor=tiny", "model.loss_chunk=128"])
    config_lib.validate(c)
    assert trainer.model_config(c).loss_chunk == 128
    assert trainer.model_config(config_lib.load(None, ["model.flavor=tiny"])).loss_chunk is None


@pytest.mark.parametrize("axis", ["tp", "pp"])
def test_loss_chunk_with_tp_or_pp_is_refused(axis):
    c = config_lib.load(None, ["model.flavor=tiny", "model.loss_chunk=128", f"parallel.{axis}=2"])
    with pytest.raises(ConfigError, match="model.loss_chunk works with parallel.tp=1 and pp=1"):
        trainer.model_config(c)


def test_loss_chunk_below_one_is_refused():
    with pytest.raises(ConfigError, match="model.loss_chunk must be >= 1, got 0"):
        config_lib.validate(config_lib.load(None, ["model.flavor=tiny", "model.loss_chunk=0"]))
