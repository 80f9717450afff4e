"""XLA flags jaxdist sets by default, before JAX starts its backends.

* `--xla_cpu_copy_insertion_use_region_analysis=true`: without it, XLA's CPU
  compiler copies every buffer a `while` loop updates in place when the loop
  also reads it elsewhere, so FSDP's `update_in_backward` would hold a second
  copy of the block state and its temp memory would grow with depth.

Flags already in `XLA_FLAGS` are left as the user set them; set
`JAXDIST_XLA_FLAGS=0` to add none. XLA aborts on a flag it does not know, so
they are added only for jaxlib versions they were checked with (0.10, 0.11). They only take effect when jaxdist is
imported before JAX initializes its backends (before the first `jax.devices()`
or computation).
"""

from __future__ import annotations

import importlib.metadata
import os

DEFAULT_FLAGS = {
    "--xla_cpu_copy_insertion_use_region_analysis": "true",
}
OPT_OUT_ENV = "JAXDIST_XLA_FLAGS"
CHECKED_JAXLIB = ((0, 10), (0, 11))


def _jaxlib_checked() -> bool:
    try:
        parts = importlib.metadata.version("jaxlib").split(".")
        return (int(parts[0]), int(parts[1])) in CHECKED_JAXLIB
    except (importlib.metadata.PackageNotFoundError, ValueError, IndexError):
        return False


def apply_default_flags() -> None:
    if os.environ.get(OPT_OUT_ENV, "1") == "0" or not _jaxlib_checked():
        return
    flags = os.environ.get("XLA_FLAGS", "")
    present = {f.split("=")[0] for f in flags.split()}
    extra = [f"{k}={v}" for k, v in DEFAULT_FLAGS.items() if k not in present]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()
