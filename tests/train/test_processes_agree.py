"""What the processes of one run must agree on before they act. A node started with a stale config
trained silently (another learning rate on one process: the loss off by 4e-3 at step 3) or hung (another
run.steps: one process in its last save's barrier, the other in its final evaluation, for good); every
process now stops at start naming the keys. A stop signal reaching the processes at different moments (a
scheduler's SIGTERM to each node) made each stop at its own step: neither could save, both were killed
after the grace period and the stop's checkpoint was lost; the processes now agree on one step and save
it."""

import signal
import sys
import time

import pytest
from support.processes import start_processes, two_processes, wait_all
from support.trainer_runs import BASE as TRAIN_BASE
from support.trainer_runs import rows


def test_processes_started_with_different_configs_each_stop_naming_the_keys(tmp_path):
    script = (
        "import os, sys; from jaxdist.train.cli import main; "
        "lr = '3e-3' if os.environ['JAXDIST_PROCESS_ID'] == '0' else '1e-3'; "
        "sys.exit(main([*sys.argv[1:], f'optim.lr={lr}']))"
    )
    cmd = [sys.executable, "-c", script, "train", *TRAIN_BASE, "run.steps=2", f"run.out_dir={tmp_path / 'run'}"]
    zero, one = two_processes(cmd, tmp_path)
    assert (zero.returncode, one.returncode) == (2, 2), zero.stdout[-3000:] + one.stdout[-3000:]
    assert "process 0's config differs from process 1's: optim.lr=0.003 here, 0.001 there" in zero.stdout
    assert "process 1's config differs from process 0's: optim.lr=0.001 here, 0.003 there" in one.stdout


# a training of 2 processes stopped by a signal (~40 s): with the slow tests
@pytest.mark.slow
def test_a_stop_signal_to_one_process_stops_both_at_one_step_which_is_saved(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "jaxdist.train.cli", "train", *TRAIN_BASE, "run.steps=100000"]
    cmd += ["run.checkpoint_every=1000", "run.eval_every=0", "run.sample_tokens=0", f"run.out_dir={run}"]
    procs = start_processes(cmd, tmp_path)
    deadline = time.monotonic() + 120
    while not ((run / "metrics.jsonl").exists() and len(rows(run)) >= 5):
        assert time.monotonic() < deadline and all(p.poll() is None for p, _ in procs), "the run did not start"
        time.sleep(0.05)
    procs[1][0].send_signal(signal.SIGTERM)  # a scheduler's stop reaching this node alone (or first)
    zero, one = wait_all(procs, cmd)
    lines = [line for out in (zero.stdout, one.stdout) for line in out.splitlines()]
    said = [line for line in lines if "interrupted; saving step" in line]
    assert len(said) == 2 and said[0] == said[1], zero.stdout[-3000:] + one.stdout[-3000:]
    step = int(said[0].rsplit(" ", 1)[1])
    assert "another process is stopping; stopping with it" in zero.stdout
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [step]
    assert rows(run)[-1]["step"] == step
