"""Config values no run can use fail at once on one line; `jaxdist train --help` lists every key."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxdist.train import config as config_lib
from jaxdist.train.array_files import ArrayFiles
from jaxdist.train.config import ConfigError
from jaxdist.train.data.prepare import prepare
from jaxdist.train.data.shards import TokenShards
from jaxdist.train.trainer import train

REPO = Path(__file__).resolve().parents[2]
BASE = ["model.flavor=tiny", "data.batch_size=16", "run.log_every=1", "run.progress=false", "optim.warmup_steps=2"]


def cfg(tmp_path, *overrides):
    return config_lib.load(None, [*BASE, f"run.out_dir={tmp_path / 'run'}", "run.steps=1", *overrides])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["run.steps=0"], "run.steps must be >= 1, got 0"),
        (["run.steps=-5"], "run.steps must be >= 1, got -5"),
        (["data.batch_size=0"], "data.batch_size must be >= 1, got 0"),
        (["optim.accumulation_steps=0"], "optim.accumulation_steps must be >= 1, got 0"),
        (["model.seq_len=0"], "model.seq_len must be >= 1, got 0"),
        (["optim.decay_steps=0"], "optim.decay_steps must be >= 1, got 0"),
        (
            ["optim.warmup_steps=100", "optim.decay_steps=50"],
            r"optim.decay_steps=50 \(the whole schedule, warmup included\) is not longer than optim.warmup_steps=100",
        ),
        (["run.out_dir="], "run.out_dir is empty; give the run's directory"),
        (["parallel.remat=sometimes"], "parallel.remat must be auto, true or false, got 'sometimes'"),
        (["parallel.comm_dtype=bfloat16"], "parallel.comm_dtype must be param or compute, got 'bfloat16'"),
        (["optim.mu_dtype=float16"], "optim.mu_dtype must be float32 or bfloat16, got 'float16'"),
        (
            ["parallel.fsdp=8", "parallel.update_in_backward=true"],
            "parallel.update_in_backward=true cannot clip by optim.max_grad_norm .*set optim.max_grad_norm=0",
        ),
    ],
)
def test_unusable_values_fail_with_a_one_line_error(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        train(cfg(tmp_path, *overrides))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()  # nothing was started


def test_a_directory_as_data_path_is_named_as_such(tmp_path):
    with pytest.raises(ValueError, match=f"data.path {tmp_path} is a directory; set data.path to a text file"):
        train(cfg(tmp_path, f"data.path={tmp_path}"))


def test_an_unwritable_out_dir_fails_with_a_one_line_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=f"run.out_dir {blocker / 'run'} is not writable .*pick a directory") as e:
        train(config_lib.load(None, [*BASE, "run.steps=1", f"run.out_dir={blocker / 'run'}"]))
    assert "\n" not in str(e.value)


def test_text_data_reads_any_bytes_not_only_utf8(tmp_path):
    """A byte-level model reads the file's bytes: a latin-1 file prepares, every byte a token."""
    raw = "café au lait, crème brûlée.\n".encode("latin-1") * 20  # 0xe9 is not valid UTF-8
    path = tmp_path / "latin1.txt"
    path.write_bytes(raw)
    prepare([path], tmp_path / "d", val_fraction=0.2, progress=False)
    parts = [TokenShards(tmp_path / "d", split) for split in ("train", "val")]
    tokens = np.concatenate([p.read(0, len(p)) for p in parts])
    assert bytes(tokens.astype(np.uint8)) == raw
    with pytest.raises(ValueError, match="latin1.txt is not UTF-8 text"):  # a text tokenizer names the file
        prepare([path], tmp_path / "e", train_bpe=300, progress=False)


def test_update_in_backward_logs_no_grad_norm_rather_than_nan(tmp_path):
    # the update-in-backward run of tests/train/test_resume_unreadable_checkpoints.py (a 4-step schedule over
    # dp 4 x fsdp 2): its compiled step
    uib = ["parallel.fsdp=2", "parallel.update_in_backward=true", "optim.max_grad_norm=0", "optim.decay_steps=4"]
    train(cfg(tmp_path, *uib))

    def no_nan(token):
        raise AssertionError(f"metrics.jsonl holds {token}")

    rows = [
        json.loads(line, parse_constant=no_nan)
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 1 and "grad_norm" not in rows[0] and rows[0]["loss"] > 0


def test_cli_rejects_zero_steps_with_one_line_and_a_nonzero_exit(tmp_path):
    out = tmp_path / "zero"
    cmd = [sys.executable, "-m", "jaxdist.train.cli", "train", "run.steps=0", f"run.out_dir={out}"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == "jaxdist train: error: run.steps must be >= 1, got 0"
    assert not out.exists()


def test_train_help_lists_every_config_key_with_its_default():
    cmd = [sys.executable, "-m", "jaxdist.train.cli", "train", "--help"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    lines = done.stdout.splitlines()
    for section in dataclasses.fields(config_lib.TrainConfig):
        assert f"[{section.name}]" in lines
        for key in dataclasses.fields(section.default_factory):
            default = "none" if key.default is None else json.dumps(key.default)
            assert any(line.split()[:3] == [f"{section.name}.{key.name}", "=", default] for line in lines), key.name


@pytest.mark.parametrize(
    ("overrides", "remat", "residuals"),
    [
        (["parallel.fsdp=8"], None, "recompute"),  # auto (the default) under FSDP: the forward recomputed
        (["parallel.fsdp=8", "parallel.remat=false"], False, "rebuild"),
        (["parallel.fsdp=4", "parallel.tp=2", "parallel.remat=true"], True, "recompute"),
        (["parallel.tp=2", "parallel.remat=auto"], None, "kept"),  # ZeRO-1 storage keeps the activations
        (
            ["parallel.fsdp=8", "parallel.update_in_backward=true", "optim.max_grad_norm=0", "parallel.remat=false"],
            False,
            "rebuild",
        ),
    ],
    ids=["fsdp-auto", "fsdp-false", "fsdp-tp-true", "tp-auto", "fsdp-update-in-backward-false"],
)
def test_parallel_remat_selects_how_backward_gets_the_activations(overrides, remat, residuals):
    """`parallel.remat` = auto | true | false reaches the unit engine as remat None / True / False."""
    import jax
    from flax import nnx

    from jaxdist.models.gpt import GPT
    from jaxdist.train import trainer

    c = config_lib.load(None, [*BASE, "model.n_layers=1", *overrides])
    config_lib.validate(c)
    mesh = trainer.make_mesh(c, jax.devices())
    model_cfg = trainer.model_config(c)
    optimizer, _ = trainer.make_optimizer(c)
    batch = {"tokens": np.zeros((16, model_cfg.seq_len + 1), np.int32)}
    run = trainer.parallelize(c, mesh, GPT(model_cfg, nnx.Rngs(0)), optimizer, batch)
    assert run.cfg.remat is remat
    assert run.cfg.backward_residuals == residuals


def test_parallel_remat_true_under_plain_ddp_is_refused_not_ignored():
    import jax
    from flax import nnx

    from jaxdist.models.gpt import GPT
    from jaxdist.train import trainer

    c = config_lib.load(None, [*BASE, "model.n_layers=1", "parallel.remat=true"])
    config_lib.validate(c)
    model_cfg = trainer.model_config(c)
    optimizer, _ = trainer.make_optimizer(c)
    batch = {"tokens": np.zeros((16, model_cfg.seq_len + 1), np.int32)}
    with pytest.raises(ConfigError, match=r"parallel.remat=true .* DDP keeps every activation"):
        trainer.parallelize(c, trainer.make_mesh(c, jax.devices()), GPT(model_cfg, nnx.Rngs(0)), optimizer, batch)


def test_parallel_remat_reads_toml_booleans_and_auto(tmp_path):
    path = tmp_path / "c.toml"
    for text, value in (("remat = false", False), ("remat = true", True), ('remat = "auto"', "auto")):
        path.write_text(f"[parallel]\n{text}\n")
        c = config_lib.load(path)
        config_lib.validate(c)
        assert c.parallel.remat == value and type(c.parallel.remat) is type(value)
    assert config_lib.TrainConfig().parallel.remat == "auto"


def _prepared(overrides):
    import jax
    from flax import nnx

    from jaxdist.models.gpt import GPT
    from jaxdist.train import trainer

    c = config_lib.load(None, [*BASE, "model.n_layers=1", *overrides])
    config_lib.validate(c)
    model_cfg = trainer.model_config(c)
    optimizer, _ = trainer.make_optimizer(c)
    rows = np.random.default_rng(0).integers(0, model_cfg.vocab_size, (16, model_cfg.seq_len + 1), dtype=np.int32)
    batch = {"tokens": rows}
    return trainer.parallelize(c, trainer.make_mesh(c, jax.devices()), GPT(model_cfg, nnx.Rngs(0)), optimizer, batch)


@pytest.mark.parametrize(
    ("overrides", "option"),
    [
        ([], "pack_buckets"),
        (["parallel.fsdp=8"], "pack_units"),
        (["parallel.tp=2"], "pack_units"),
        (["parallel.pp=2", "model.n_layers=2"], "pack_units"),
    ],
    ids=["ddp", "fsdp", "tp", "pp"],
)
def test_pack_buckets_reaches_every_strategy(overrides, option):
    """`parallel.pack_buckets=false`: each DDP bucket, or each unit of the engine, one grouped collective over
    its parameters in place."""
    assert getattr(_prepared(overrides).cfg, option) is True
    assert getattr(_prepared(["parallel.pack_buckets=false", *overrides]).cfg, option) is False


@pytest.mark.parametrize(
    ("overrides", "option"),
    [
        ([], "reduce_dtype"),  # DDP: the gradients; ZeRO-1 gathers the float32 master parameters
        (["parallel.fsdp=8"], "compute_dtype"),
        (["parallel.tp=2"], "compute_dtype"),
        (["parallel.pp=2", "model.n_layers=2"], "compute_dtype"),
    ],
    ids=["ddp", "fsdp", "tp", "pp"],
)
def test_comm_dtype_compute_reaches_every_strategy(overrides, option):
    import jax.numpy as jnp

    run = _prepared(["model.dtype=bfloat16", "parallel.comm_dtype=compute", *overrides])
    assert getattr(run.cfg, option) == jnp.bfloat16  # the default (param) is None: the next test builds one


def test_comm_dtype_compute_gathers_what_the_model_computes_with():
    """FSDP with bfloat16 compute: casting each shard before its gather is the model's own cast at use, so
    the step's loss is bit-identical; the gradients, reduced in bfloat16, move the parameters as a float32
    reduction does to within bfloat16 rounding."""
    import jax

    runs = [
        _prepared(["model.dtype=bfloat16", "parallel.fsdp=8", f"parallel.comm_dtype={d}"]) for d in ("param", "compute")
    ]
    rows = np.random.default_rng(1).integers(0, 256, (16, 65), dtype=np.int32)  # the tiny GPT's vocab, seq_len + 1
    before = [np.asarray(x, np.float32) for x in jax.tree.leaves(runs[0].params(runs[0].state))]  # steps donate
    outs = [run.step(run.state, {"tokens": rows}) for run in runs]
    (s_param, m_param), (s_compute, m_compute) = outs
    assert runs[0].cfg.compute_dtype is None and float(m_param["loss"]) == float(m_compute["loss"])
    # the gradients' scale is the same: a sum where a mean is due would show in the norm (Adam's step would not)
    np.testing.assert_allclose(float(m_compute["grad_norm"]), float(m_param["grad_norm"]), rtol=1e-2)
    moved = [jax.tree.leaves(runs[i].params(s)) for i, s in enumerate((s_param, s_compute))]
    for b, p, c in zip(before, *moved, strict=True):
        step = np.abs(np.asarray(p, np.float32) - b).max()
        np.testing.assert_allclose(
            np.asarray(c, np.float32), np.asarray(p, np.float32), rtol=0, atol=0.02 * step + 1e-7
        )


# slow (four trainer runs): the fast run checks the refusal itself (the next test) and the bfloat16 moments
# under each strategy and in their canonical state (tests/strategies/test_optimizer_state_dtypes.py)
@pytest.mark.slow
def test_a_bfloat16_first_moment_is_saved_as_such_and_a_resume_must_ask_for_it(tmp_path):
    """optim.mu_dtype=bfloat16 checkpoints bfloat16 first moments (float32 second ones); resuming without
    the key is refused on one line naming it, the checkpoint left in place (a config change, not damage);
    resuming with it continues exactly as the run that was never stopped."""
    keys = ["run.checkpoint_every=2", "optim.decay_steps=10", "optim.mu_dtype=bfloat16"]
    straight = train(cfg(tmp_path / "straight", "run.steps=3", *keys))
    train(cfg(tmp_path, "run.steps=2", *keys))
    saved = ArrayFiles(tmp_path / "run" / "checkpoints" / "2" / "arrays")
    dtypes = {
        (name.split("/")[2], saved.shape_dtype(name)[1].name)
        for name in saved.leaves
        if "/mu/" in name or "/nu/" in name
    }
    assert dtypes == {("mu", "bfloat16"), ("nu", "float32")}, dtypes
    with pytest.raises(ConfigError, match="first moment in bfloat16, this run asks for optim.mu_dtype=float32") as e:
        train(cfg(tmp_path, "run.steps=3", *keys[:2]))
    assert "\n" not in str(e.value) and "set optim.mu_dtype=bfloat16 to resume" in str(e.value)
    assert (tmp_path / "run" / "checkpoints" / "2" / "arrays").is_dir()
    assert train(cfg(tmp_path, "run.steps=3", *keys)) == straight[2:]


@pytest.mark.parametrize("meta", [{}, {"config": None}, {"config": {"optim": {}}}], ids=["no-config", "none", "no-key"])
def test_a_checkpoint_that_records_no_mu_dtype_counts_as_float32(tmp_path, meta):
    """Checkpoints from before optim.mu_dtype kept float32 moments: they resume by default, and a run asking
    for bfloat16 is refused naming the run directory to export."""
    from jaxdist.train.trainer import check_same_moment_dtype

    check_same_moment_dtype(meta, "float32", tmp_path / "checkpoints")
    with pytest.raises(ConfigError, match=f"first moment in float32, .*`jaxdist export {tmp_path} OUT`"):
        check_same_moment_dtype(meta, "bfloat16", tmp_path / "checkpoints")
