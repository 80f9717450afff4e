"""Refuse a train step that cannot fit, before the first step: XLA's compile-time memory analysis.

The step is compiled ahead of time (the executable the run then uses, so nothing compiles twice) and its
per-device footprint, arguments + outputs + temporaries - the donated buffers reused as outputs, is
compared with what a device holds: the allocator's `bytes_limit` on a GPU, and on CPU, where every
simulated device of a process shares the host, MemAvailable of /proc/meminfo split over the processes
`jaxdist launch` started on this host. `$JAXDIST_MEMORY_LIMIT_BYTES` sets the per-device limit instead.
A step over it stops the run with one line (a ConfigError: the CLI exits with status 2) instead of the
kernel's OOM killer ending it minutes later without a word.
"""

from __future__ import annotations

import os

from jaxdist.train.config import ConfigError

LIMIT_ENV = "JAXDIST_MEMORY_LIMIT_BYTES"
LOCAL_PROCESSES_ENV = "JAXDIST_LOCAL_PROCESSES"  # set by `jaxdist launch`: its processes share the host


def step_bytes(analysis) -> int:
    """Per-device bytes a compiled program needs at its peak: its arguments, outputs and temporaries,
    less the outputs that reuse donated argument buffers."""
    return (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        + analysis.temp_size_in_bytes
        - analysis.alias_size_in_bytes
    )


def host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo, in bytes (None where there is none)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def device_limit(device, local_devices: int) -> tuple[int, str] | None:
    """(bytes one device may use, where that figure comes from), or None where nothing says."""
    if os.environ.get(LIMIT_ENV):
        return int(os.environ[LIMIT_ENV]), f"${LIMIT_ENV}"
    if device.platform == "cpu":
        available = host_available_bytes()
        if available is None:
            return None
        processes = max(1, int(os.environ.get(LOCAL_PROCESSES_ENV) or 1))
        share = f"the host's available memory ({_gib(available)})"
        if processes * local_devices > 1:
            share += f" over {processes * local_devices} CPU devices"
        return available // (processes * local_devices), share
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.device_kind}'s memory limit"
    return None


def check_fits(analysis, device, local_devices: int) -> None:
    """Raise a one-line ConfigError when the compiled step's `memory_analysis()` exceeds the device's limit."""
    if analysis is None:
        return
    limit = device_limit(device, local_devices)
    need = step_bytes(analysis)
    if limit is None or need <= limit[0]:
        return
    raise ConfigError(
        f"the compiled train step needs {_gib(need)} per device (arguments {_gib(analysis.argument_size_in_bytes)}"
        f" + outputs {_gib(analysis.output_size_in_bytes)} + temporaries {_gib(analysis.temp_size_in_bytes)}"
        f" - donated {_gib(analysis.alias_size_in_bytes)}), more than the {_gib(limit[0])} of {limit[1]}; "
        "lower model.seq_len or data.batch_size, recompute activations (parallel.remat=true), or shard over "
        "more devices (parallel.fsdp, parallel.tp)"
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"
