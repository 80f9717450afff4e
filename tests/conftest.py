"""Test setup: 8 simulated CPU devices, and the GPU markers.

XLA reads XLA_FLAGS when its CPU client starts, so this runs before jax is
imported by any test module.
"""

import collections
import importlib.util
import os

# 8 devices; and where no CUDA plugin is installed (the CPU runs), LLVM's level 1 for the compiled code:
# compiling is most of the suite's time, and the suite ran 18% faster than at the default level 3
# (tests/README.md), its results the same within the tests' tolerances. On a GPU, XLA's deterministic ops:
# tests that compare a resumed run with an uninterrupted one bit for bit need the same numbers from the
# same program, and a GPU's sums by atomic adds (whose order varies from run to run) differ in the last
# bits between processes (train/test_checkpoint_kill.py: 1.4e-6 apart on an H200 without it, equal with it).
_FLAGS = ["--xla_force_host_platform_device_count=8"]
if not any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13)):
    _FLAGS.append("--xla_backend_optimization_level=1")
else:
    _FLAGS.append("--xla_gpu_deterministic_ops=true")
for _flag in _FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

# GPU tests share the GPUs with worker processes they start (multi-process bootstrap, the
# watchdog): XLA's default grab of 75% of each GPU would leave those workers, and NCCL's own
# allocations, out of memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

# the shared helpers assert too (reference comparisons, whole-loop checks): pytest explains their failures
pytest.register_assert_rewrite("support")


def _gpu_count() -> int:
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


def pytest_collection_modifyitems(config, items):
    gpus = _gpu_count()
    in_parallel = bool(os.environ.get("PYTEST_XDIST_WORKER"))
    for item in items:
        if gpus and in_parallel and ("gpu" in item.keywords or "multigpu" in item.keywords):
            # two workers would share the GPUs (memory, NCCL communicators): GPU tests run in one process
            item.add_marker(
                pytest.mark.skip(reason="GPU tests run without -n: python -m pytest -m 'gpu or multigpu' tests")
            )
        elif "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2+ GPUs, found {gpus}"))
        elif "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a GPU"))
    # Files of more slow (or long) tests first, then files of more tests first (a file stays whole and in
    # order). Under `-n 2 --dist loadfile --no-loadscope-reorder` workers take files in this order, so the
    # minutes-long files start at once instead of ending the run on one worker.
    slow = collections.Counter(item.path for item in items if "slow" in item.keywords or "long" in item.keywords)
    count = collections.Counter(item.path for item in items)
    items.sort(key=lambda item: (-slow[item.path], -count[item.path]))


@pytest.fixture(scope="session")
def trained_layouts(tmp_path_factory):
    """Each checkpoint layout of tests/support/layouts.py trained once, shared by the tests that compare layouts."""
    from support.layouts import trained_layouts_once

    yield from trained_layouts_once(tmp_path_factory)


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    """One XLA compile per distinct program per test run: most tests train the same tiny models on
    the same meshes, each run through new jit closures, and on CPU the compiles are most of the suite's
    time. A persistent cache in a fresh directory of this test run (nothing carries over between
    runs), also read by the processes tests start (they inherit the environment). A cached program
    is the executable the compile made: results are the same. CPU only: untried with the GPU tests'
    NCCL custom calls, and the time goes on the CPU runner."""
    if _gpu_count():
        yield
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n: the workers of this run share one cache
        shared = tmp_path_factory.getbasetemp().parent / "jax-compilation-cache"
        shared.mkdir(exist_ok=True)
        directory = str(shared)
    else:
        directory = str(tmp_path_factory.mktemp("jax-compilation-cache"))
    settings = {"jax_compilation_cache_dir": directory, "jax_persistent_cache_min_compile_time_secs": 0}
    saved = {name: os.environ.get(name.upper()) for name in settings}
    for name, value in settings.items():
        jax.config.update(name, value)
        os.environ[name.upper()] = str(value)
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name.upper(), None)
        else:
            os.environ[name.upper()] = value
