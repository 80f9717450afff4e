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


SLOW_STEPS = """
import os, sys, time
from jaxdist.train import hooks
from jaxdist.train.cli import main

real = hooks.Loader.batches
def batches(self, *args, **kwargs):  # each step ~1 s: a large model's, against a grace period of 1.5 s
    for batch in real(self, *args, **kwargs):
        time.sleep(1.0)
        yield batch
hooks.Loader.batches = batches
sys.exit(main(sys.argv[1:]))
"""


# a training of 2 processes stopped by a signal (~30 s each): with the slow tests
@pytest.mark.slow
@pytest.mark.parametrize(
    "signalled, long_steps",
    [((1,), False), ((0, 1), True)],
    ids=["one-process", "both-with-steps-near-the-grace-period"],
)
def test_a_stop_signal_stops_every_process_at_one_step_which_is_saved(tmp_path, monkeypatch, signalled, long_steps):
    """Long steps: the agreed boundary comes two or three steps after the signal, each boundary restarting
    the grace period (which ended the processes before the agreed step, unsaved)."""
    run = tmp_path / "run"
    start = ["-c", SLOW_STEPS] if long_steps else ["-m", "jaxdist.train.cli"]
    cmd = [sys.executable, *start, "train", *TRAIN_BASE, "run.steps=100000"]
    cmd += ["run.checkpoint_every=1000", "run.eval_every=0", "run.sample_tokens=0", f"run.out_dir={run}"]
    if long_steps:
        monkeypatch.setenv("JAXDIST_STOP_GRACE_S", "1.5")
    procs = start_processes(cmd, tmp_path)
    deadline = time.monotonic() + 120
    while not ((run / "metrics.jsonl").exists() and len(rows(run)) >= 5):
        assert time.monotonic() < deadline and all(p.poll() is None for p, _ in procs), "the run did not start"
        time.sleep(0.05)
    for rank in signalled:  # a scheduler's stop reaching one node alone (or first), or each
        procs[rank][0].send_signal(signal.SIGTERM)
    zero, one = wait_all(procs, cmd)
    lines = [line for out in (zero.stdout, one.stdout) for line in out.splitlines()]
    said = [line for line in lines if "interrupted; saving step" in line]
    assert len(said) == 2 and said[0] == said[1], zero.stdout[-3000:] + one.stdout[-3000:]
    step = int(said[0].rsplit(" ", 1)[1])
    if signalled == (1,):
        assert "another process is stopping; stopping with it" in zero.stdout
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [step]
    assert rows(run)[-1]["step"] == step


TWO_RUNS = """
import os, jax
from jaxdist.train.launch import initialize_args
jax.distributed.initialize(**initialize_args(os.environ))
from jaxdist.train.peers import check_same_config
check_same_config({"run": {"steps": 2}})
check_same_config({"run": {"steps": 4}})  # a second run in the same processes: compared with its own
print("both runs agreed", flush=True)
"""


def test_a_second_run_in_the_same_processes_is_compared_with_its_own_configs(tmp_path):
    """Its keys were the first run's (a set key keeps its first value): a false mismatch with itself."""
    zero, one = two_processes([sys.executable, "-c", TWO_RUNS], tmp_path)
    assert "both runs agreed" in zero.stdout and "both runs agreed" in one.stdout, zero.stdout + one.stdout
