"""`jaxdist launch`: rank-prefixed output, a dead worker named and the rest stopped, loopback coordinator."""

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxdist.train.launch import initialize_args

REPO = Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, "-m", "jaxdist.train.cli", "launch"]
# each worker says hello; rank 1 then does `ACTION`, the others sleep as if blocked in a collective
WORKER = """
import os, signal, sys, time
rank = int(os.environ["JAXDIST_PROCESS_ID"])
print(f"hello from {rank}", flush=True)
gloo = f"[Gloo] Rank {rank} is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
print(gloo, file=sys.stderr, flush=True)
if rank == 1:
    ACTION
time.sleep(SLEEP)
"""


def launch(action: str, n: int = 2, sleep: int = 120) -> tuple[subprocess.CompletedProcess, float]:
    script = WORKER.replace("ACTION", action).replace("SLEEP", str(sleep))
    began = time.monotonic()
    done = subprocess.run(
        [*LAUNCH, "-n", str(n), "--", sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    return done, time.monotonic() - began


def test_worker_output_is_prefixed_with_its_rank_and_gloo_connection_lines_are_dropped():
    done, _ = launch("pass", sleep=0)
    assert done.returncode == 0
    assert "[rank 0] hello from 0" in done.stdout.splitlines()
    assert "[rank 1] hello from 1" in done.stdout.splitlines()
    assert "Gloo" not in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("action", "how", "code"),
    [
        ("sys.exit(3)", "exited with status 3", 3),
        ("os.kill(os.getpid(), signal.SIGKILL)", "was killed by SIGKILL", 137),
    ],
)
def test_a_dead_worker_is_named_and_the_others_are_stopped_at_once(action, how, code):
    done, seconds = launch(action, n=3)
    assert done.returncode == code
    assert f"jaxdist launch: rank 1 {how}; stopping the other 2 running worker(s)" in done.stderr
    assert seconds < 30  # ranks 0 and 2 sleep 120 s unless stopped


def test_an_unknown_command_fails_with_one_line():
    done = subprocess.run([*LAUNCH, "-n", "2", "--", "nosuchcommand"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 127
    assert done.stderr.strip() == "jaxdist launch: cannot run nosuchcommand: No such file or directory"


def test_the_coordinator_binds_only_the_address_workers_connect_to():
    env = {"JAXDIST_COORDINATOR": "127.0.0.1:4321", "JAXDIST_NUM_PROCESSES": "2", "JAXDIST_PROCESS_ID": "0"}
    assert initialize_args(env) == {
        "coordinator_address": "127.0.0.1:4321",
        "num_processes": 2,
        "process_id": 0,
        "coordinator_bind_address": "127.0.0.1:4321",  # jax's default is [::]:4321, every interface
    }
    multi_node = {**env, "JAXDIST_COORDINATOR": "10.0.0.5:4321", "JAXDIST_COORDINATOR_BIND": "10.0.0.5:4321"}
    assert initialize_args(multi_node)["coordinator_bind_address"] == "10.0.0.5:4321"
    assert initialize_args({"SLURM_NTASKS": "4"}) == {}  # jax detects the cluster itself
    assert initialize_args({"SLURM_NTASKS": "4", "JAXDIST_COORDINATOR_BIND": "10.0.0.5:1"}) == {
        "coordinator_bind_address": "10.0.0.5:1"
    }


def listening_addresses(port: int) -> set[str]:
    """Local addresses of the TCP sockets listening on `port` (hex as in /proc/net/tcp{,6})."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:
                found.add(address)
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def test_a_real_launch_listens_on_loopback_only(tmp_path):
    port = free_port()
    init = (
        "import os, time; from jaxdist.train.trainer import init_distributed; init_distributed(); "
        "print('joined', flush=True); time.sleep(4)"
    )
    cmd = [*LAUNCH, "-n", "2", "--cpu-devices", "1", "--port", str(port), "--", sys.executable, "-c", init]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = set()
    while proc.poll() is None:
        seen |= listening_addresses(port)
        time.sleep(0.05)
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-2000:]
    assert out.count("joined") == 2
    assert seen and seen <= LOOPBACK, seen


def test_each_process_owns_its_share_of_the_gpus():
    from jaxdist.train.launch import gpus_for_rank, visible_gpus

    assert [gpus_for_rank(["0", "1", "2", "3"], 2, r) for r in (0, 1)] == ["0,1", "2,3"]
    assert [gpus_for_rank(["4", "7"], 2, r) for r in (0, 1)] == ["4", "7"]
    assert gpus_for_rank([], 2, 0) is None  # no GPUs: nothing set
    with pytest.raises(ValueError, match="3 GPUs do not split evenly over 2 processes"):
        gpus_for_rank(["0", "1", "2"], 2, 0)
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,5"}) == ["2", "5"]
