"""The checkpoint settings are checked like every other key (README: "Every key is checked"): a value
no run can use stops it with a one-line ConfigError instead of being read as something else."""

import pytest

from jaxdist.train import config as config_lib
from jaxdist.train.config import ConfigError, validate


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("run.keep_checkpoints=0", "run.keep_checkpoints must be >= 1, got 0"),
        ("run.checkpoint_every=-2", "run.checkpoint_every must be >= 1 .* or -1 \\(none\\), got -2"),
    ],
)
def test_unusable_checkpoint_settings_are_refused_on_one_line(override, message):
    with pytest.raises(ConfigError, match=message) as e:
        validate(config_lib.load(None, [override]))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("override", ["run.keep_checkpoints=1", "run.checkpoint_every=-1", "run.checkpoint_every=0"])
def test_the_documented_checkpoint_settings_are_accepted(override):
    validate(config_lib.load(None, [override]))


@pytest.mark.parametrize("value", ["-1.0", "nan"])
def test_a_negative_or_nan_max_grad_norm_is_refused_not_read_as_no_clipping(value):
    with pytest.raises(ConfigError, match="optim.max_grad_norm must be >= 0 \\(0 disables clipping\\)"):
        validate(config_lib.load(None, [f"optim.max_grad_norm={value}"]))
    validate(config_lib.load(None, ["optim.max_grad_norm=0"]))  # the documented "no clipping"
