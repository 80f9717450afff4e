"""The trainer trains every model family: `model.family` with its flavor and overrides, a few steps under a
tensor-parallel (Llama) and a sharded (Gemma) layout, evaluation, the end-of-run sample, and
`jaxdist sample` on the checkpoint, which records the family. Settings a family does not have, or a
layout that cannot split the model, are one-line ConfigErrors before anything compiles."""

import dataclasses
import json

import numpy as np
import pytest
from flax import nnx

from jaxdist.models import families
from jaxdist.models.gpt import GPTConfig
from jaxdist.train import cli, sample, trainer
from jaxdist.train import config as config_lib
from jaxdist.train.config import ConfigError
from jaxdist.train.export import read_params

BASE = [
    "model.flavor=tiny",
    "model.seq_len=32",
    "data.source=synthetic",
    "data.batch_size=8",
    "run.steps=2",
    "run.log_every=1",
    "run.progress=false",
    "run.eval_every=2",
    "run.eval_batches=1",
    "run.sample_tokens=4",
    "optim.warmup_steps=1",
]


def cfg(out_dir, *overrides):
    return config_lib.load(None, [*BASE, f"run.out_dir={out_dir}", *overrides])


@pytest.mark.parametrize(
    ("family", "layout", "model_class"),
    [
        ("llama", ["parallel.tp=2"], "Llama"),
        # Gemma through the trainer is slow: the fast run trains Gemma under strategies in
        # tests/models/test_decoder_strategies.py, and a family through the whole loop as llama-dp4xtp2
        pytest.param("gemma", ["parallel.fsdp=2"], "Gemma", marks=pytest.mark.slow),
        # a local and a global layer, one per stage: each stage runs its own layer's kind
        pytest.param("gemma", ["parallel.pp=2", "parallel.microbatches=2"], "Gemma", marks=pytest.mark.slow),
    ],
    ids=["llama-dp4xtp2", "gemma-hsdp4x2", "gemma-pp2xdp4"],
)
def test_a_family_trains_evaluates_samples_and_its_checkpoint_samples_again(
    tmp_path, capsys, family, layout, model_class
):
    out = tmp_path / family
    losses = trainer.train(cfg(out, f"model.family={family}", *layout))
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert 4.0 < losses[0] < 6.0  # about log(256): a byte-level vocabulary at initialisation
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert np.isfinite(rows[-1]["val_loss"])
    assert "jaxdist: sample after 2 steps:" in capsys.readouterr().out

    step, meta, params = read_params(out)
    assert step == 2 and meta["model"]["family"] == family
    model, tokenizer, _ = sample.load_run(out)
    assert type(model).__name__ == model_class and tokenizer is None
    assert model.cfg == dataclasses.replace(families.from_record(meta["model"]), attention=None)
    loaded = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    np.testing.assert_array_equal(loaded["embed"]["embedding"], params["embed"]["embedding"])

    assert cli.main(["sample", str(out), "--prompt", "3 14 15", "--tokens", "6", "--temperature", "0"]) == 0
    ids = capsys.readouterr().out.split()
    assert ids[:3] == ["3", "14", "15"] and len(ids) == 9 and all(0 <= int(t) < 256 for t in ids)


def test_the_gpts_checkpoint_record_is_unchanged():
    """A GPT's record names no family, as its checkpoints always did: old runs resume and compare equal."""
    gpt = GPTConfig()
    assert families.record(gpt) == dataclasses.asdict(gpt)
    assert families.from_record(dataclasses.asdict(gpt)) == gpt
    assert trainer.model_config(config_lib.load(None, [])) == dataclasses.replace(
        families.get("gpt").flavors["tiny"], dtype=np.dtype("float32")
    )


def test_flavor_and_overrides_build_the_familys_config():
    got = trainer.model_config(
        config_lib.load(
            None,
            ["model.family=llama", "model.flavor=small-cpu", "model.n_kv_heads=4", "model.sliding_window=8"],
        )
    )
    want = dataclasses.replace(families.get("llama").flavors["small-cpu"], n_kv_heads=4, sliding_window=8)
    assert got == dataclasses.replace(want, dtype=np.dtype("float32"))
    no_window = trainer.model_config(config_lib.load(None, ["model.family=gemma", "model.sliding_window=0"]))
    assert no_window.sliding_window is None and all(no_window.is_global(i) for i in range(no_window.n_layers))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.family=t5"], "unknown model.family 't5'; choose one of gpt, llama, gemma"),
        (["model.family=llama", "model.flavor=124m"], "unknown model.flavor '124m' of model.family=llama"),
        (["model.n_kv_heads=2"], "model.n_kv_heads is not a setting of model.family=gpt; leave it unset"),
        (["model.family=gemma", "model.tie_embeddings=false"], "model.tie_embeddings is not a setting of"),
        (["model.family=llama", "model.n_kv_heads=3"], "n_heads=4 must be a multiple of n_kv_heads=3"),
    ],
)
def test_settings_the_family_cannot_take_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        trainer.model_config(config_lib.load(None, overrides))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["model.family=llama", "model.n_kv_heads=1", "parallel.tp=2"],
            r"parallel.tp=2 cannot split this model: model.n_kv_heads=1 is not divisible by tp=2",
        ),
        (
            ["model.family=gemma", "model.n_layers=3", "parallel.pp=2", "parallel.microbatches=2"],
            r"parallel.pp=2: Pipelined: 3 blocks do not split into pp \* virtual = 2 stages of equal length",
        ),
    ],
)
def test_layouts_that_cannot_split_the_model_are_refused_before_compiling(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        trainer.train(cfg(tmp_path / "run", *overrides))


def test_zero_bubble_pipeline_with_tp_trains_q_k_norm_models_as_1f1b(tmp_path):
    """Llama's tiny flavor has q/k norms, whose gradients are summed over tp by a collective: zb-h1's
    split backward ran that collective in B without the value it reads, which only W computed
    (KeyError in backward_split); Gemma's every flavor has them too."""
    layout = ["model.family=llama", "model.n_layers=2", "parallel.pp=2", "parallel.microbatches=2", "parallel.tp=2"]
    losses = {}
    for schedule in ("1f1b", "zb-h1"):
        out = tmp_path / schedule
        trainer.train(cfg(out, *layout, f"parallel.schedule={schedule}", "run.sample_tokens=0", "run.eval_every=0"))
        losses[schedule] = [row["loss"] for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    np.testing.assert_allclose(losses["zb-h1"], losses["1f1b"], rtol=1e-6)
