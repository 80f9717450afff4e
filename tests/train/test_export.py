"""`jaxdist export RUN_DIR OUT` writes the parameters as a plain orbax checkpoint that Flax loads
without jaxdist (the docs' loading snippet, below), and `run.init_from=OUT` starts a run from them."""

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from support.exported import readme_load
from support.layouts import GPT_CFG, LAYOUTS, OPTIMIZER, batches, make_model
from support.trainer_runs import BASE

from jaxdist.models.gpt import GPT
from jaxdist.train import config as config_lib
from jaxdist.train.checkpoint import CheckpointError, Checkpoints
from jaxdist.train.cli import main
from jaxdist.train.trainer import train


def test_export_of_a_tp_run_loads_with_flax_alone_as_the_runs_own_parameters(tmp_path, capsys):
    """dp x tp stores the fused qkv columns in another order: the export is the model's own order."""
    data = batches(1)
    # the optimizer of tests/support/layouts.py: the step and the conversion are compiles the test run already has
    run = LAYOUTS["dp4xtp2"](make_model(), OPTIMIZER, data[0])
    state, _ = run.step(run.state, data[0])
    ckpt = Checkpoints(tmp_path / "run", keep=1)
    ckpt.save(1, run.canonical(state), {"model": "tiny"})
    ckpt.close()
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    assert "the parameters of step 1" in capsys.readouterr().out
    loaded = readme_load(tmp_path / "out", GPT(GPT_CFG, nnx.Rngs(1)))
    expected = nnx.to_pure_dict(run.params(state))  # the strategy's own gather, not the canonical form
    actual = nnx.to_pure_dict(nnx.state(loaded, nnx.Param))
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 2  # never overwrites
    assert "already exists" in capsys.readouterr().err


def test_init_from_starts_a_new_run_from_exported_parameters(tmp_path):
    # test_train's settings: the 2-step run is a program of tests/train/test_train_run.py (its second step learns)
    train(config_lib.load(None, [*BASE, "run.steps=2", f"run.out_dir={tmp_path / 'a'}"]))
    assert main(["export", str(tmp_path / "a"), str(tmp_path / "a.params")]) == 0
    # one step, whose learning rate is the warmup's first, exactly 0 (the schedule starts at 0; no weight
    # decay): the new run's checkpoint holds exactly the parameters it started from. The settings of the
    # 2-step run above: one compiled program
    init_from = f"run.init_from={tmp_path / 'a.params'}"
    over = [*BASE, "run.steps=1", init_from, f"run.out_dir={tmp_path / 'b'}"]
    train(config_lib.load(None, over))
    assert main(["export", str(tmp_path / "b"), str(tmp_path / "b.params")]) == 0
    a, b = (ocp.StandardCheckpointer().restore(tmp_path / n) for n in ("a.params", "b.params"))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    fresh = nnx.to_pure_dict(nnx.state(GPT(GPT_CFG, nnx.Rngs(0)), nnx.Param))
    assert len(jax.tree.leaves(a)) == len(jax.tree.leaves(fresh))
    with pytest.raises(CheckpointError, match="does not hold this model's parameters"):
        train(
            config_lib.load(
                None, [*BASE, "model.d_model=32", "run.steps=1", init_from, f"run.out_dir={tmp_path / 'c'}"]
            )
        )
