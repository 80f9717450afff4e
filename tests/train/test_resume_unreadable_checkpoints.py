"""Resuming when checkpoints are unreadable, and resuming a run that started from exported parameters.

* Every checkpoint unreadable: the run must not silently start over from step 0 (which replaces the
  run's metrics and, at its next save, its checkpoints): the README refuses starting from step 0 where
  a run exists unless run.overwrite=true, and so must this path.
* A run started with run.init_from resumes from its own checkpoint: the exported parameters are not
  read again, so moving or deleting them after the start must not stop the resume.
"""

import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from support.trainer_runs import rows
from support.trainer_runs import tiny_run_config as cfg
from support.trainer_runs import truncate_checkpoint as _truncate
from support.trainer_runs import two_checkpoints as two_checkpoints  # the module's fixture

from jaxdist.train.checkpoint import CheckpointError, Checkpoints
from jaxdist.train.cli import main
from jaxdist.train.trainer import train


def test_every_checkpoint_unreadable_refuses_to_start_over_and_keeps_the_metrics(two_checkpoints, tmp_path):
    base, _ = two_checkpoints
    out = tmp_path / "run"
    shutil.copytree(base, out)
    for step in ("2", "4"):
        _truncate(out / "checkpoints" / step)
    with pytest.raises(CheckpointError, match="no readable checkpoint left.*run.overwrite=true") as e:
        train(cfg(out, "run.steps=4", "run.checkpoint_every=2"))
    assert "\n" not in str(e.value)
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4]  # the run's history is untouched
    assert sorted(p.name for p in (out / "checkpoints.unreadable").iterdir()) == ["2", "4"]  # kept, aside
    assert "it keeps checkpoints.unreadable/" in str(e.value)

    # starting over as the error says deletes the run's checkpoints and rows, never what was set aside
    train(cfg(out, "run.steps=1", "run.checkpoint_every=1", "run.overwrite=true"))
    assert [r["step"] for r in rows(out)] == [1]
    assert sorted(p.name for p in (out / "checkpoints.unreadable").iterdir()) == ["2", "4"]


def test_a_run_from_exported_parameters_resumes_without_them(two_checkpoints, tmp_path):
    base, _ = two_checkpoints
    exported = tmp_path / "exported"
    assert main(["export", str(base), str(exported)]) == 0
    init_from = f"run.init_from={exported}"
    whole = train(cfg(tmp_path / "whole", "run.steps=3", init_from, "run.checkpoint_every=-1"))
    first = train(cfg(tmp_path / "split", "run.steps=3", init_from), stop_after=2)
    shutil.rmtree(exported)  # the run has its own checkpoint now
    rest = train(cfg(tmp_path / "split", "run.steps=3", init_from))
    np.testing.assert_array_equal(first + rest, whole)


def test_export_skips_a_corrupt_newest_checkpoint_and_says_so_without_talking_of_resuming(
    two_checkpoints, tmp_path, capsys
):
    base, _ = two_checkpoints
    out = tmp_path / "run"
    shutil.copytree(base, out)
    _truncate(out / "checkpoints" / "4")
    capsys.readouterr()
    assert main(["export", str(out), str(tmp_path / "exported")]) == 0
    captured = capsys.readouterr()
    assert "the parameters of step 2" in captured.out
    assert captured.err.count("\n") == 1 and "checkpoints/4 is unreadable" in captured.err
    assert "resuming" not in captured.err  # export resumes nothing
    reader = Checkpoints(base, keep=9)
    expected = reader.restore_params(2)
    reader.close()
    exported = ocp.StandardCheckpointer().restore(tmp_path / "exported")
    assert jax.tree.structure(exported) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(exported), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_update_in_backward_saves_and_resumes_exactly(tmp_path):
    """The README said FSDP with update_in_backward neither saves nor reads checkpoints; it does both (its
    run has the engine's canonical form), and its resume continues bit for bit."""
    uib = ["parallel.fsdp=2", "parallel.update_in_backward=true", "optim.max_grad_norm=0", "run.steps=4"]
    whole = train(cfg(tmp_path / "whole", *uib, "run.checkpoint_every=-1"))
    first = train(cfg(tmp_path / "run", *uib), stop_after=2)
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["2"]
    rest = train(cfg(tmp_path / "run", *uib))
    np.testing.assert_array_equal(first + rest, whole)
