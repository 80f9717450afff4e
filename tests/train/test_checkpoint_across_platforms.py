"""A checkpoint resumes on another platform: the trainer picks the attention implementation by platform
(cuDNN flash attention for a bfloat16 GPU run, XLA's choice elsewhere) and records it with the model,
but it is not part of the model's parameters or the canonical state, so it must not make the same
run's checkpoint "a checkpoint of another model". The reference is an uninterrupted run."""

import dataclasses

import numpy as np
from support.trainer_runs import tiny_run_config as cfg

from jaxdist.train import trainer


def test_a_checkpoint_written_with_another_attention_implementation_resumes(tmp_path, monkeypatch):
    whole = trainer.train(cfg(tmp_path / "whole", "run.steps=4", "run.checkpoint_every=-1"))
    real = trainer.model_config
    # the first part runs as a GPU run records itself (an explicit implementation; "xla" also runs on CPU)
    monkeypatch.setattr(trainer, "model_config", lambda c: dataclasses.replace(real(c), attention="xla"))
    first = trainer.train(cfg(tmp_path / "run", "run.steps=4"), stop_after=2)
    monkeypatch.undo()
    rest = trainer.train(cfg(tmp_path / "run", "run.steps=4"))
    np.testing.assert_array_equal(first + rest, whole)
