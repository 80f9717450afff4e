"""`jaxdist export` edges: a model with more than ten blocks (orbax hands list keys back as strings,
"10" sorting before "2"), and a run directory that does not exist (a read-only command must not
create it)."""

import jax
import numpy as np
import optax
from flax import nnx
from support.exported import readme_load
from support.meshes import cpu_mesh

from jaxdist.ddp.run import DDP
from jaxdist.models.gpt import GPT, GPTConfig, next_token_loss
from jaxdist.train.checkpoint import Checkpoints
from jaxdist.train.cli import main
from jaxdist.train.export import load_params

ELEVEN = GPTConfig(vocab_size=32, seq_len=8, d_model=8, n_heads=2, n_layers=11)


def test_export_of_eleven_blocks_keeps_each_block_in_its_place(tmp_path):
    batch = {"tokens": np.zeros((4, 9), np.int32)}
    run = DDP(cpu_mesh((2,), ("dp",)), zero1=True).prepare(
        GPT(ELEVEN, nnx.Rngs(3)), optax.adam(1e-3), next_token_loss, batch
    )
    ckpt = Checkpoints(tmp_path / "run", keep=1)
    ckpt.save(1, run.canonical(run.state), {"model": "eleven"})
    ckpt.close()
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    expected = nnx.to_pure_dict(run.params(run.state))  # every block initialised differently
    for loaded in (
        nnx.to_pure_dict(nnx.state(readme_load(tmp_path / "out", GPT(ELEVEN, nnx.Rngs(9))), nnx.Param)),
        nnx.to_pure_dict(load_params(tmp_path / "out", nnx.state(GPT(ELEVEN, nnx.Rngs(9)), nnx.Param))),
    ):
        assert jax.tree.structure(loaded) == jax.tree.structure(expected)
        for i in (2, 10):
            np.testing.assert_array_equal(
                np.asarray(loaded["blocks"][i]["qkv"]["kernel"]), np.asarray(expected["blocks"][i]["qkv"]["kernel"])
            )
        for a, e in zip(jax.tree.leaves(loaded), jax.tree.leaves(expected), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def test_export_of_a_missing_run_directory_fails_on_one_line_and_creates_nothing(tmp_path, capsys):
    missing = tmp_path / "no-such-run"
    assert main(["export", str(missing), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no checkpoints" in err
    assert not missing.exists() and not (tmp_path / "out").exists()


def test_export_says_what_is_missing_a_checkpoint_yet_a_step_or_a_readable_one(tmp_path, capsys):
    """It said 'holds no readable checkpoint; check the run directory' for a run that had simply not
    saved yet, and the set-aside warning said 'the previous one is used' where there was none."""
    run = tmp_path / "run"
    Checkpoints(run, keep=3).close()  # a run that has made its checkpoints/ and saved nothing yet
    assert main(["export", str(run), str(tmp_path / "out")]) == 2
    assert "holds no checkpoint yet (a run saves one every run.checkpoint_every steps" in capsys.readouterr().err
    ckpt = Checkpoints(run, keep=3)
    ckpt.save(2, {"w": np.ones(4, np.float32)}, {})
    ckpt.close()
    assert main(["export", str(run), str(tmp_path / "out"), "--step", "1"]) == 2
    assert "holds no checkpoint of step 1 (it has steps 2)" in capsys.readouterr().err
    data = max((p for p in (run / "checkpoints" / "2").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    assert main(["export", str(run), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "left in place, there is none older" in err and "holds no readable checkpoint (the warnings above" in err
