"""A multi-process save whose step directory cannot be created (the run directory turned read-only, or
out of inodes): orbax's process 0 fails to create it while the others wait for word of it in the
key-value store, and every process was silent for 5 minutes (orbax's timeout), then process 1 ended on
an orbax internal error. Now the directory is tried first on process 0 and every process stops at once
with the reason, the previous checkpoint kept."""

import os
import sys

import pytest
from support.processes import two_processes
from support.trainer_runs import BASE as TRAIN_BASE

NO_DIRECTORIES_AFTER_THE_FIRST_SAVE = """
import errno, os, sys
from pathlib import Path
from jaxdist.train.cli import main

if os.environ["JAXDIST_PROCESS_ID"] == "0":  # the disk this process writes the directories on is full
    real = os.mkdir
    def mkdir(path, *args, **kwargs):
        path = Path(path)
        if path.parent.name == "checkpoints" and (path.parent / "2").is_dir():
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, *args, **kwargs)
    os.mkdir = mkdir
sys.exit(main(sys.argv[1:]))
"""


# a training of 2 processes (~20 s): with the slow tests
@pytest.mark.slow
def test_a_step_directory_process_0_cannot_create_stops_every_process_at_once(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-c", NO_DIRECTORIES_AFTER_THE_FIRST_SAVE, "train", *TRAIN_BASE, "run.steps=6"]
    cmd += ["run.checkpoint_every=2", f"run.out_dir={run}"]
    zero, one = two_processes(cmd, tmp_path)  # (a deadline of 120 s: the hang took 310)
    assert zero.returncode != 0 and one.returncode != 0, zero.stdout[-3000:] + one.stdout[-3000:]
    said = f"jaxdist train: error: could not save the checkpoint of step 4: no space left on device ({run}/checkpoints)"
    assert said in zero.stdout and said in one.stdout, zero.stdout[-3000:] + one.stdout[-3000:]
    assert sorted(os.listdir(run / "checkpoints")) == ["2"]
