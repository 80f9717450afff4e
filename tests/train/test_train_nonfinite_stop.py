"""A run whose steps keep having a NaN/Inf loss stops with a non-zero exit and one line naming the step,
and the checkpoints saved before (all of the last good parameters) are kept."""

import json
import math

import numpy as np
import pytest

from jaxdist.train import cli
from jaxdist.train.checkpoint import Checkpoints
from jaxdist.train.data.shards import Loader

VOCAB = 64
BASE = [
    "model.flavor=tiny",
    f"model.vocab_size={VOCAB}",
    "model.n_layers=1",
    "model.d_model=32",
    "model.n_heads=2",
    "model.seq_len=16",
    "data.source=synthetic",
    "data.batch_size=8",
    "run.steps=40",
    "run.log_every=100",
    "run.checkpoint_every=2",
    "run.keep_checkpoints=10",
    "run.progress=false",
]


@pytest.fixture
def poisoned_from(monkeypatch):
    """Batches of steps >= `first` (0-based) hold token ids past the vocabulary: the embedding lookup
    reads NaN for them (jnp.take's fill), so those steps' loss and gradients are NaN."""
    original = Loader.local_batches

    def arm(first: int) -> None:
        def local_batches(self, start, offset=0):
            for i, local in enumerate(original(self, start, offset), start=start):
                yield {**local, "tokens": np.full_like(local["tokens"], 10 * VOCAB)} if i >= first else local

        monkeypatch.setattr(Loader, "local_batches", local_batches)

    return arm


@pytest.fixture
def poisoned_at(monkeypatch):
    """The batch of each 0-based step in `steps` holds token ids past the vocabulary: that step is NaN."""
    original = Loader.local_batches

    def arm(*steps: int) -> None:
        def local_batches(self, start, offset=0):
            for i, local in enumerate(original(self, start, offset), start=start):
                yield {**local, "tokens": np.full_like(local["tokens"], 10 * VOCAB)} if i in steps else local

        monkeypatch.setattr(Loader, "local_batches", local_batches)

    return arm


def test_nan_steps_in_a_row_stop_the_run_and_keep_the_good_checkpoints(tmp_path, poisoned_from, capsys):
    poisoned_from(4)  # steps 5, 6, 7, ... (1-based, as the metrics and the message count) are NaN
    out = tmp_path / "run"
    code = cli.main(["train", *BASE, "run.max_skipped_steps=3", f"run.out_dir={out}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith("jaxdist train: error: stopped at step 7: 3 steps in a row had a NaN/Inf loss")
    assert "lower optim.lr" in err[-1] and "check the data" in err[-1]
    ckpt = Checkpoints(out, keep=10)
    try:
        # saved before the stop: 2 and 4 trained, 6 after two skipped steps; nothing saved after the stop
        assert sorted(ckpt.manager.all_steps()) == [2, 4, 6]
        params = {s: ckpt.restore_params(s) for s in (2, 4, 6)}
    finally:
        ckpt.close()
    flat = {s: [np.asarray(x) for x in _leaves(p)] for s, p in params.items()}
    assert all(np.isfinite(x).all() for s in flat for x in flat[s])
    # the skipped steps changed nothing: step 6 holds step 4's parameters, which differ from step 2's
    for a, b in zip(flat[4], flat[6], strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(flat[2], flat[4], strict=True))


def test_update_in_backward_stops_at_the_first_nan_loss_before_saving_it(tmp_path, poisoned_from, capsys):
    # FSDP's update_in_backward has applied a step's update before its loss is known: it cannot skip one
    poisoned_from(2)  # step 3 is NaN; the checkpoint of step 4 would hold NaN parameters
    layout = ["parallel.fsdp=8", "parallel.update_in_backward=true", "optim.max_grad_norm=0"]
    code = cli.main(["train", *BASE, *layout, f"run.out_dir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith("jaxdist train: error: stopped at step 3: its loss is NaN/Inf and parallel.update_in")
    ckpt = Checkpoints(tmp_path, keep=10)
    try:
        assert sorted(ckpt.manager.all_steps()) == [2]
    finally:
        ckpt.close()


# slow: the fast run stops on NaN steps in a row with saves and log rows (above) and in the update-in-backward step
@pytest.mark.slow
def test_without_saves_or_rows_the_stop_comes_within_the_limit_and_zero_disables_it(tmp_path, poisoned_from, capsys):
    poisoned_from(4)
    quiet = [*BASE, "run.checkpoint_every=-1"]  # nothing reads the losses back but the count itself
    assert cli.main(["train", *quiet, "run.max_skipped_steps=3", f"run.out_dir={tmp_path / 'a'}"]) == 1
    assert "error: stopped at step 7: 3 steps in a row" in capsys.readouterr().err
    assert cli.main(["train", *quiet, "run.max_skipped_steps=0", f"run.out_dir={tmp_path / 'b'}"]) == 0
    assert "done: step 40, final loss nan" in capsys.readouterr().out


def _leaves(tree):
    if isinstance(tree, dict):
        return [x for k in sorted(tree) for x in _leaves(tree[k])]
    return [tree]


def _lr(updates: int, peak=1e-2, warmup=2, decay=10, min_ratio=0.1) -> float:
    """The schedule by hand: linear warmup over `warmup` updates, then cosine to peak * min_ratio at `decay`."""
    if updates < warmup:
        return peak * updates / warmup
    frac = min(1.0, (updates - warmup) / (decay - warmup))
    return peak * min_ratio + peak * (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))


def test_a_skipped_step_does_not_advance_the_schedule_and_the_rows_say_the_lr_applied(tmp_path, poisoned_at):
    """The optimizer's schedule counts the updates applied (a skipped step keeps its state, count included,
    as Megatron-LM's scheduler does); the rows showed the lr of the step's number instead, from the skipped
    step on and after a resume (at 3 of 6 steps: 0.010 shown, 0.005 applied)."""
    poisoned_at(1)  # step 2 (1-based) is skipped
    out = tmp_path / "run"
    schedule = ["optim.lr=1e-2", "optim.warmup_steps=2", "optim.decay_steps=10", "optim.min_lr_ratio=0.1"]
    run = [*BASE, *schedule, "run.log_every=1", "run.checkpoint_every=3", f"run.out_dir={out}"]
    assert cli.main(["train", *run, "run.steps=3"]) == 0
    assert cli.main(["train", *run, "run.steps=6"]) == 0  # resumed at step 3, one update short of it
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["skipped"] for r in rows] == [False, True, False, False, False, False]
    applied = [0, 1, 1, 2, 3, 4]  # updates applied before each step
    np.testing.assert_allclose([r["lr"] for r in rows], [_lr(n) for n in applied], rtol=1e-6)
