"""Every numeric config key has a range, checked at load time: a value outside it (NaN and infinities
included) is a one-line error naming the key, the value and the range, and `jaxdist train` exits 2."""

import dataclasses
import math
import re
import typing

import pytest

from jaxdist.train import cli
from jaxdist.train import config as config_lib
from jaxdist.train.config import ConfigError, TrainConfig


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lr=-1", "optim.lr must be > 0, got -1.0"),
        ("optim.lr=0", "optim.lr must be > 0, got 0.0"),
        ("optim.lr=nan", "optim.lr must be > 0, got nan"),
        ("optim.lr=inf", "optim.lr must be > 0, got inf"),
        ("optim.warmup_steps=-3", "optim.warmup_steps must be >= 0, got -3"),
        ("optim.b1=1.5", "optim.b1 must be in [0, 1), got 1.5"),
        ("optim.b2=1", "optim.b2 must be in [0, 1), got 1.0"),
        ("optim.min_lr_ratio=1.5", "optim.min_lr_ratio must be in [0, 1], got 1.5"),
        ("optim.weight_decay=-0.1", "optim.weight_decay must be >= 0, got -0.1"),
        ("optim.max_grad_norm=nan", "optim.max_grad_norm must be >= 0 (0 disables clipping), got nan"),
        ("run.log_every=0", "run.log_every must be >= 1, got 0"),
        ("run.eval_every=-1", "run.eval_every must be >= 0 (0: never), got -1"),
        ("run.eval_batches=0", "run.eval_batches must be >= 1, got 0"),
        ("run.sample_tokens=-5", "run.sample_tokens must be >= 0, got -5"),
        ("run.step_timeout_s=-1", "run.step_timeout_s must be >= 0 (0: off), got -1.0"),
        ("run.max_skipped_steps=-1", "run.max_skipped_steps must be >= 0 (0: never), got -1"),
        ("parallel.dp=0", "parallel.dp must be >= 1 or -1 (every device not used by fsdp, tp, cp and pp), got 0"),
        ("parallel.bucket_mb=0", "parallel.bucket_mb must be > 0, got 0.0"),
        ("parallel.microbatches=0", "parallel.microbatches must be >= 1, got 0"),
        ("parallel.buffers=1", "parallel.buffers must be >= 2, got 1"),
        ("data.val_fraction=-0.1", "data.val_fraction must be in [0, 1), got -0.1"),
        ("data.val_fraction=1", "data.val_fraction must be in [0, 1), got 1.0"),
        ("data.stride=-1", "data.stride must be >= 0 (0: seq_len), got -1"),
        ("model.n_heads=0", "model.n_heads must be >= 1, got 0"),
    ],
)
def test_value_outside_its_range_is_refused_at_load(override, message):
    with pytest.raises(ConfigError) as e:
        config_lib.load(None, [override])
    assert str(e.value) == message


def _numeric_keys():
    for section, cls in typing.get_type_hints(TrainConfig).items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kinds = {t for t in (typing.get_args(hints[f.name]) or (hints[f.name],)) if t is not type(None)}
            if kinds & {int, float} and bool not in kinds:
                yield section, f, kinds


def test_every_numeric_key_declares_a_range_that_refuses_nan_and_what_lies_below_it():
    keys = list(_numeric_keys())
    assert len(keys) > 30
    for section, f, kinds in keys:
        allowed = f.metadata.get("range")
        assert allowed is not None, f"{section}.{f.name} has no range"
        default = getattr(getattr(TrainConfig(), section), f.name)
        assert default is None or default in allowed, f"{section}.{f.name}'s default {default} is outside it"
        bad = ["-1000000000"] + (["nan", "inf", "-inf"] if float in kinds else [])
        for value in bad:
            with pytest.raises(ConfigError) as e:
                config_lib.load(None, [f"{section}.{f.name}={value}"])
            got = float(value) if float in kinds else int(value)
            assert str(e.value) == f"{section}.{f.name} must be {allowed}, got {got!r}"


def test_a_valid_override_replaces_a_bad_file_value(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[optim]\nlr = -1.0\n")
    assert config_lib.load(path, ["optim.lr=0.01"]).optim.lr == 0.01
    with pytest.raises(ConfigError, match=r"^optim.lr must be > 0, got -1.0$"):
        config_lib.load(path)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[run]\nsteps = true", "run.steps must be an integer, got True"),
        ("[optim]\nlr = true", "optim.lr must be a number, got True"),
        ("[run]\ncheckpoint_every = false", "run.checkpoint_every must be an integer, got False"),
        ("[data]\npath = ['a.txt', 'b.txt']", "data.path must be text, got ['a.txt', 'b.txt']"),
    ],
)
def test_a_toml_value_of_another_type_is_refused_not_converted(tmp_path, toml, message):
    """TOML's true read as 1 (run.checkpoint_every = false as 0: "only at the end", not -1: "none")."""
    path = tmp_path / "c.toml"
    path.write_text(toml + "\n")
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        config_lib.load(path)


def test_a_command_line_value_keeps_its_spaces_where_they_are_text():
    cfg = config_lib.load(None, ["run.sample_prompt= The river ", "run.steps= 7 ", "run.progress= false"])
    assert (cfg.run.sample_prompt, cfg.run.steps, cfg.run.progress) == (" The river ", 7, False)


def test_a_config_built_in_code_is_checked_by_validate():
    cfg = TrainConfig()
    cfg.optim.lr = math.nan
    with pytest.raises(ConfigError, match=r"^optim.lr must be > 0, got nan$"):
        config_lib.validate(cfg)


def test_cli_prints_one_line_and_exits_2(capsys):
    assert cli.main(["train", "optim.lr=-1", "run.steps=1"]) == 2
    assert capsys.readouterr().err == "jaxdist train: error: optim.lr must be > 0, got -1.0\n"


def test_help_shows_the_ranges(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = capsys.readouterr().out
    assert "optim.lr = 0.003" in text and "(must be > 0)" in text
    assert "(must be in [0, 1))" in text  # b1, b2
