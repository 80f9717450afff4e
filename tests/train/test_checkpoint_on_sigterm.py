"""SIGTERM (a scheduler's stop) while the run's final save is still being written: README promises that
a stop "finishes the save in flight". The run has printed its summary and is waiting for the last
save in `close`; the signal must not kill it half-done (its checksums unwritten, or orbax's writes
cut short), and the run then ends normally."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from support.trainer_runs import BASE

from jaxdist.train.checksums import CHECKSUMS

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("slow_final_save_driver.py")
ARGS = [
    *BASE,  # support.trainer_runs' tiny settings: the program other tests compile, from the test run's cache
    "run.steps=2",
    "run.checkpoint_every=0",  # only the final save
]


def test_sigterm_while_the_final_save_is_written_lets_it_finish(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(DRIVER), "4", *ARGS, f"run.out_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("jaxdist: done:"):  # the summary: the final save is in flight (4 s of checksums)
                break
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, rest
    assert "driver: train returned" in rest
    assert (out / "checkpoints" / "2" / CHECKSUMS).is_file()  # the save completed, checksums included
