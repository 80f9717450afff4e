"""A train step whose compiled footprint exceeds the device's memory is refused before training, on one line
naming the estimate, the limit and the keys to change (exit status 2), from XLA's compile-time analysis."""

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from support.trainer_runs import BASE

from jaxdist.train import memory
from jaxdist.train.config import ConfigError

REPO = Path(__file__).resolve().parents[2]
# support.trainer_runs' tiny settings: the program other tests compile, from the test run's compilation cache
TRAIN = [sys.executable, "-m", "jaxdist.train.cli", "train", *BASE, "run.steps=2"]


def analysis(arguments: int, outputs: int, temporaries: int, donated: int):
    return types.SimpleNamespace(
        argument_size_in_bytes=arguments,
        output_size_in_bytes=outputs,
        temp_size_in_bytes=temporaries,
        alias_size_in_bytes=donated,
    )


CPU = types.SimpleNamespace(platform="cpu", device_kind="cpu")


def test_the_estimate_is_arguments_outputs_and_temporaries_less_the_donated_buffers():
    assert memory.step_bytes(analysis(100, 80, 50, 70)) == 160  # outputs written into donated arguments count once


def test_cpu_devices_share_the_hosts_available_memory_with_the_other_local_processes(monkeypatch):
    monkeypatch.delenv(memory.LIMIT_ENV, raising=False)
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 64 * 2**30)
    monkeypatch.setenv(memory.LOCAL_PROCESSES_ENV, "2")
    limit, where = memory.device_limit(CPU, local_devices=4)
    assert limit == 8 * 2**30  # 64 GiB over 2 processes x 4 devices
    memory.check_fits(analysis(2**30, 2**30, 6 * 2**30, 2**30), CPU, 4)  # 7 GiB: fits
    with pytest.raises(ConfigError) as refused:
        memory.check_fits(analysis(2**30, 2**30, 8 * 2**30, 2**30), CPU, 4)  # 9 GiB
    message = str(refused.value)
    assert "\n" not in message
    assert "needs 9.00 GiB per device" in message and "more than the 8.00 GiB" in message
    assert "model.seq_len" in message and "data.batch_size" in message and "parallel.remat" in message


def test_a_gpu_is_limited_by_its_allocators_bytes_limit(monkeypatch):
    monkeypatch.delenv(memory.LIMIT_ENV, raising=False)
    gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200", memory_stats=lambda: {"bytes_limit": 1000})
    assert memory.device_limit(gpu, local_devices=8) == (1000, "NVIDIA H200's memory limit")


def run(tmp_path, *extra, env=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env or {}))
    cmd = [*TRAIN, *extra, f"run.out_dir={tmp_path / 'run'}"]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_a_step_over_the_limit_is_refused_on_one_line_before_training(tmp_path):
    done = run(tmp_path, env={memory.LIMIT_ENV: str(2**20)})  # 1 MiB per device: the tiny step needs more
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("jaxdist train: error: the compiled train step needs ")
    assert "more than the 1.0 MiB of $JAXDIST_MEMORY_LIMIT_BYTES" in lines[0]
    assert "model.seq_len" in lines[0]
    assert "step 1" not in done.stdout  # refused before the first step
    assert not (tmp_path / "run" / "checkpoints").exists() or not os.listdir(tmp_path / "run" / "checkpoints")
