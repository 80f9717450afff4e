"""`parallel.backend=nccl` on a machine without NVIDIA GPUs is a one-line error naming
`parallel.backend=xla` (exit 2), given before any data is prepared."""

import jax
import pytest
from support.meshes import cpu_mesh

from jaxdist.comm import nccl
from jaxdist.train import cli

pytestmark = pytest.mark.skipif(jax.devices()[0].platform == "gpu", reason="this machine has GPUs")


def test_cli_refuses_nccl_on_cpu_in_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    code = cli.main(["train", "parallel.backend=nccl", "data.source=synthetic", f"run.out_dir={out}"])
    assert code == 2
    assert capsys.readouterr().err == (
        "jaxdist train: error: parallel.backend=nccl needs NVIDIA GPUs, but this run's 8 devices are cpu; "
        "set parallel.backend=xla\n"
    )
    assert not out.exists()  # refused before the run directory (and its data) were made


def test_nccl_init_on_a_cpu_mesh_names_the_platform():
    with pytest.raises(RuntimeError, match=r"^the nccl backend needs a mesh of CUDA GPUs, this one has cpu devices"):
        nccl.init(cpu_mesh((8,), ("x",)))
