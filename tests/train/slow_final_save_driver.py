"""A training run whose checkpoints' checksum pass (the last part of a save) takes SLOW_S seconds, so the
final save is still in flight after the run's summary line (tests/train/test_checkpoint_on_sigterm.py).
Usage: python slow_final_save_driver.py SLOW_S KEY=VALUE..."""

import sys
import time

from jaxdist.train import checkpoint
from jaxdist.train import config as config_lib
from jaxdist.train.trainer import train

slow_s = float(sys.argv[1])
real = checkpoint.Checkpoints._write_checksums


def slow_checksums(self, step):
    time.sleep(slow_s)
    real(self, step)


checkpoint.Checkpoints._write_checksums = slow_checksums
train(config_lib.load(None, sys.argv[2:]))
print("driver: train returned", flush=True)
