"""`parallel.cp` in the trainer: range-checked, placed in the mesh between the data axes and tp,
and a run with cp = 4 (x tp = 2 on 8 devices) trains with the losses of the same run without cp."""

import jax
import numpy as np
import pytest

from jaxdist.train import config as config_lib
from jaxdist.train.config import ConfigError
from jaxdist.train.trainer import make_mesh, train


def test_parallel_cp_below_one_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^parallel.cp must be >= 1, got 0$"):
        config_lib.load(None, ["parallel.cp=0"])


@pytest.mark.parametrize(
    ("overrides", "shape"),
    [
        (["parallel.cp=4", "parallel.tp=2"], {"dp": 1, "cp": 4, "tp": 2}),
        (["parallel.cp=2", "parallel.fsdp=2"], {"dp": 2, "fsdp": 2, "cp": 2}),
        (["parallel.cp=2", "parallel.pp=2"], {"pp": 2, "dp": 2, "cp": 2}),
    ],
)
def test_the_cp_axis_sits_inside_the_data_axes_and_outside_tp(overrides, shape):
    mesh = make_mesh(config_lib.load(None, overrides), jax.devices()[:8])
    assert dict(mesh.shape) == shape


def test_sizes_that_do_not_multiply_to_the_devices_name_cp():
    with pytest.raises(ConfigError, match=r"parallel.dp x fsdp x tp x cp = 3 x 1 x 1 x 2 does not multiply"):
        make_mesh(config_lib.load(None, ["parallel.cp=2", "parallel.dp=3"]), jax.devices()[:8])


BASE = [
    "model.flavor=tiny",
    "data.batch_size=8",
    "run.log_every=1",
    "run.progress=false",
    "run.eval_every=0",
    "run.sample_tokens=0",
    "parallel.tp=2",
]


def run(tmp_path, name, *overrides, **kwargs):
    return train(config_lib.load(None, [*BASE, f"run.out_dir={tmp_path / name}", *overrides]), **kwargs)


@pytest.mark.slow
def test_a_cp4_run_has_the_losses_of_the_run_without_cp(tmp_path):
    without = run(tmp_path, "plain", "run.steps=3", "run.checkpoint_every=-1")
    with_cp = run(tmp_path, "cp", "run.steps=3", "run.checkpoint_every=-1", "parallel.cp=4")
    np.testing.assert_allclose(with_cp, without, rtol=1e-5)


@pytest.mark.slow
def test_a_checkpoint_saved_under_cp_resumes_without_it_and_back(tmp_path):
    whole = run(tmp_path, "whole", "run.steps=4", "run.checkpoint_every=-1")  # dp=4 x tp=2 throughout
    first = run(tmp_path, "moved", "run.steps=4", "parallel.cp=4", stop_after=2)  # cp=4 x tp=2, saved at step 2
    middle = run(tmp_path, "moved", "run.steps=4", stop_after=1)  # resumed without cp, saved at step 3
    last = run(tmp_path, "moved", "run.steps=4", "parallel.cp=2")  # resumed with cp=2 x dp=2 x tp=2
    np.testing.assert_allclose(first + middle + last, whole, rtol=1e-5)


def test_cp_on_a_model_started_from_a_hugging_face_directory_is_refused_naming_its_family(tmp_path):
    """model.family stays unset (the default, gpt) when config.json gives it: the refusal names the model's."""
    from support import hf_configs, hf_reference

    start = hf_reference.write_checkpoint(
        tmp_path / "llama", hf_configs.LLAMA, hf_reference.random_weights(hf_configs.LLAMA)
    )
    cfg = config_lib.load(
        None,
        ["parallel.cp=2", f"run.init_from=hf:{start}", "data.source=synthetic", "model.seq_len=16"]
        + [f"run.out_dir={tmp_path / 'run'}", "run.progress=false"],
    )
    with pytest.raises(ConfigError, match="set parallel.cp=1 for llama$"):
        train(cfg)
