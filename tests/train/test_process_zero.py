"""Errors of one process in a multi-process run. Process 0's work for every process (preparing data,
clearing or locking the run directory, moving a bad checkpoint aside): when it fails, every process
stops at once saying why, instead of the others waiting at a barrier until jax's shutdown barrier
times out (5 minutes, the others silent). An error one rank finds alone ends that rank at once, and
`jaxdist launch` names it.

The processes are wired by hand, as SLURM or a script would (`jaxdist launch` would stop the others as
soon as process 0 exits, hiding the hang)."""

import os
import subprocess
import sys

import numpy as np
import pytest
from support.processes import DEADLINE_S, REPO, two_processes
from support.trainer_runs import BASE as TRAIN_BASE
from support.trainer_runs import rows, tiny_run_config, truncate_checkpoint

from jaxdist.train.trainer import train

DRIVER = """
import jax
from jaxdist.train.launch import initialize_args
import os
jax.distributed.initialize(**initialize_args(os.environ))
from jaxdist.train.process_zero import ProcessZeroError, on_process_zero

print("result", on_process_zero(lambda: 42, "answering"), flush=True)

def fail():
    raise ValueError("the disk is on fire; put it out")

try:
    on_process_zero(fail, "checking the disk")
except ValueError as e:
    print("process 0's own error:", e, flush=True)
except ProcessZeroError as e:
    print("told:", e, flush=True)
"""


SHARED_ERROR = """
import os, sys, time
import jax
from jaxdist.train.launch import initialize_args
jax.distributed.initialize(**initialize_args(os.environ))
from jaxdist.train.ending import end_after_error
rank = jax.process_index()
if rank == 1:
    time.sleep(1.0)  # a slower exit path (closing checkpoints): process 0 must not end the job under it
print(f"rank {rank}: error: the same for everyone", flush=True)
end_after_error(2)
"""


def test_every_process_learns_the_result_or_process_0s_error(tmp_path):
    zero, one = two_processes([sys.executable, "-c", DRIVER], tmp_path)
    assert zero.returncode == 0 and one.returncode == 0, zero.stdout + one.stdout
    assert "result 42" in zero.stdout and "result None" in one.stdout
    assert "process 0's own error: the disk is on fire; put it out" in zero.stdout
    assert "told: process 0 failed checking the disk: the disk is on fire; put it out" in one.stdout


def test_data_that_process_0_cannot_prepare_stops_every_trainer_on_one_line(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cmd = [sys.executable, "-m", "jaxdist.train.cli", "train", "model.flavor=tiny", "data.source=text"]
    cmd += [f"data.path={empty}", "run.steps=2", f"run.out_dir={tmp_path / 'run'}", "run.progress=false"]
    zero, one = two_processes(cmd, tmp_path)
    assert zero.returncode == 2 and one.returncode == 2, zero.stdout + one.stdout
    said = "the input is empty; give text files with some text"
    assert f"jaxdist train: error: {said}" in zero.stdout
    assert f"jaxdist train: error: process 0 failed preparing {empty}: {said}" in one.stdout


def test_an_error_on_one_rank_alone_ends_the_launch_at_once_naming_that_rank(tmp_path):
    """A data path missing on one node: rank 1 stopped on its one-line error but then waited in jax's
    shutdown barrier for 5 minutes (rank 0 blocked in a collective for it), both aborted, and the launcher
    blamed rank 0 (SIGABRT, status 134). Now rank 1 ends at once and is the rank named."""
    for node in ("node0", "node1"):  # each process's working directory: a node's own disk
        (tmp_path / node).mkdir()
    (tmp_path / "node0" / "text.txt").write_text("hello world " * 500)  # the same config: node 1 lacks the file
    train = f"{sys.executable} -m jaxdist.train.cli train model.flavor=tiny data.source=text run.steps=2"
    train += f" run.progress=false run.out_dir={tmp_path / 'run'} data.path=text.txt"
    per_rank = f"cd {tmp_path}/node$JAXDIST_PROCESS_ID && PYTHONPATH={REPO} exec {train}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [sys.executable, "-m", "jaxdist.train.cli", "launch", "-n", "2", "--cpu-devices", "2", "--"]
    done = subprocess.run(
        [*cmd, "bash", "-c", per_rank], env=env, cwd=REPO, capture_output=True, text=True, timeout=DEADLINE_S
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "[rank 1] jaxdist train: error: data file text.txt does not exist" in done.stderr
    assert "jaxdist launch: rank 1 exited with status 2" in done.stderr
    assert "[rank 0] Traceback" not in done.stderr, done.stderr[-3000:]  # (a broken collective: one line)


def test_an_error_every_process_raises_is_printed_by_each_before_any_ends(tmp_path):
    """Process 0 hosts the coordination service: ending at once, it aborted the others within ~70 ms,
    before a slower one had printed its error. It now waits until they have ended too."""
    zero, one = two_processes([sys.executable, "-c", SHARED_ERROR], tmp_path)
    assert (zero.returncode, one.returncode) == (2, 2), zero.stdout + one.stdout
    assert "rank 0: error: the same for everyone" in zero.stdout
    assert "rank 1: error: the same for everyone" in one.stdout


# two trainings of 2 processes (~1 min): with the slow tests, beside the trainer's other multi-process runs
@pytest.mark.slow
def test_a_damaged_checkpoint_is_set_aside_by_every_process_and_the_run_resumes_from_the_one_before(tmp_path):
    """Process 0 verifies the checksums for all, says why and moves the checkpoint aside, and every process
    resumes from the previous one: steps 3 and 4 then train again as they did the first time."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "jaxdist.train.cli", "train", *TRAIN_BASE, "run.steps=4", "run.checkpoint_every=2"]
    cmd.append(f"run.out_dir={run}")
    first = two_processes(cmd, tmp_path)
    assert [done.returncode for done in first] == [0, 0], first[0].stdout[-3000:] + first[1].stdout[-3000:]
    losses = {row["step"]: row["loss"] for row in rows(run)}
    truncate_checkpoint(run / "checkpoints" / "4")

    again = two_processes(cmd, tmp_path)
    assert [done.returncode for done in again] == [0, 0], again[0].stdout[-3000:] + again[1].stdout[-3000:]
    said = f"checkpoint {run / 'checkpoints' / '4'} is unreadable (arrays/"  # process 0 speaks for all
    assert said in again[0].stdout and "moved to" in again[0].stdout, again[0].stdout[-3000:]
    assert (run / "checkpoints.unreadable" / "4").is_dir()
    assert sorted(os.listdir(run / "checkpoints"), key=int) == ["2", "4"]
    retrained = {row["step"]: row["loss"] for row in rows(run)}  # the last row of each step
    np.testing.assert_allclose([retrained[s] for s in (3, 4)], [losses[s] for s in (3, 4)], rtol=1e-6)


READ_FAILS_ON_RANK_1 = """
import os, sys
from jaxdist.train import checkpoint
from jaxdist.train.cli import main

if os.environ["JAXDIST_PROCESS_ID"] == "1":  # this host alone cannot read the files process 0 verified
    def failing_read(self, step, target):
        raise OSError(5, "Input/output error", str(self.directory / str(step) / "arrays"))
    checkpoint.Checkpoints.restore = failing_read
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_read_failing_on_one_process_alone_stops_the_run_at_once_and_keeps_the_checkpoint(tmp_path):
    """Process 1 went on to move the checkpoint aside (a broadcast) while process 0 waited in the restore's
    closing barrier, another collective: both hung for good (7 minutes seen, SIGTERM ignored). A read that
    fails after process 0 verified the files now stops the run, naming the process; nothing is moved."""
    run = tmp_path / "run"
    train(tiny_run_config(run, "run.steps=4", "run.checkpoint_every=2"))
    cmd = [sys.executable, "-c", READ_FAILS_ON_RANK_1, "train", *TRAIN_BASE, "run.steps=6", "run.checkpoint_every=2"]
    zero, one = two_processes([*cmd, f"run.out_dir={run}"], tmp_path)
    assert (zero.returncode, one.returncode) == (2, 2), zero.stdout[-3000:] + one.stdout[-3000:]
    said = f"process 1 could not read checkpoint {run / 'checkpoints' / '4'} (Input/output error)"
    assert said in one.stdout and "so it is left in place" in one.stdout, one.stdout[-3000:]
    # process 0 read it, but the collective closing its read broke with process 1: it names process 1's error
    said_by_zero = "process 1 could not read checkpoint {} (Input/output error), which ended process 0's read too"
    assert said_by_zero.format(run / "checkpoints" / "4") in zero.stdout, zero.stdout[-3000:]
    assert sorted(os.listdir(run / "checkpoints"), key=int) == ["2", "4"]
    assert not (run / "checkpoints.unreadable").exists()
