"""Finding and loading jaxdist's compiled FFI library (built from ffi/).

The pure-Python parts of jaxdist never need it; the `nccl` comm backend does.
A missing or unloadable library raises `NativeLibraryError` saying why.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from pathlib import Path

FFI_LIBRARY = "libjaxdist_ffi.so"
FAKE_NCCL_LIBRARY = "libjaxdist_fake_nccl.so"
LIBRARY_ENV = "JAXDIST_FFI_LIBRARY"


class NativeLibraryError(RuntimeError):
    """jaxdist's compiled library (or a library it loads) is missing or unusable."""


def library_dirs() -> list[Path]:
    """Where the build puts the compiled libraries: beside the library
    $JAXDIST_FFI_LIBRARY names (a developer's own build), next to this package,
    or in the site-packages copy an editable install keeps them in."""
    override = [Path(os.environ[LIBRARY_ENV]).resolve().parent] if os.environ.get(LIBRARY_ENV) else []
    here = Path(__file__).resolve().parents[1] / "_lib"  # jaxdist/_lib, beside jaxdist/comm
    others = [Path(p) / "jaxdist" / "_lib" for p in sys.path if p]
    return list(dict.fromkeys([*override, here, *others]))


def find_library(name: str) -> Path | None:
    for d in library_dirs():
        if (d / name).is_file():
            return d / name
    return None


@functools.cache
def ffi_library() -> ctypes.CDLL:
    """Load libjaxdist_ffi.so once; raise NativeLibraryError with the fix if it cannot be."""
    path = os.environ.get(LIBRARY_ENV) or find_library(FFI_LIBRARY)
    if path is None:
        raise NativeLibraryError(
            f"jaxdist's compiled FFI library ({FFI_LIBRARY}) was not found in "
            f"{[str(d) for d in library_dirs()]}. It is built by `pip install .` on Linux "
            f"(CMake builds ffi/); or point ${LIBRARY_ENV} at a built copy."
        )
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise NativeLibraryError(f"cannot load jaxdist's FFI library {path}: {e}") from None
    _declare(lib)
    return lib


def loaded() -> bool:
    """Whether the FFI library has been loaded in this process (nothing to shut down otherwise)."""
    return ffi_library.cache_info().currsize > 0


def _declare(lib: ctypes.CDLL) -> None:
    c = ctypes
    sig = {
        "jaxdist_nccl_load": (c.c_int, [c.c_char_p, c.c_char_p, c.c_int]),
        "jaxdist_nccl_version": (c.c_int, []),
        "jaxdist_nccl_unique_id": (c.c_int, [c.c_char_p, c.c_char_p, c.c_int]),
        "jaxdist_unique_id_bytes": (c.c_int, []),
        "jaxdist_comm_init": (
            c.c_int,
            [
                c.c_int64,
                c.c_int,
                c.c_char_p,
                c.POINTER(c.c_int),
                c.POINTER(c.c_int),
                c.POINTER(c.c_int),
                c.c_int,
                c.c_char_p,
                c.c_char_p,
                c.c_int,
            ],
        ),
        "jaxdist_comm_wait_ready": (c.c_int, [c.c_int64, c.c_char_p, c.c_int]),
        "jaxdist_comm_destroy": (c.c_int, [c.c_int64, c.c_char_p, c.c_int]),
        "jaxdist_set_timeout_ms": (None, [c.c_int64]),
        "jaxdist_set_debug_delay_us": (None, [c.c_int64]),
        "jaxdist_set_poll_mode": (None, [c.c_int]),
        "jaxdist_poll_counts": (None, [c.POINTER(c.c_int64)]),
        "jaxdist_poll_counts_reset": (None, []),
        "jaxdist_watchdog_start": (None, [c.c_int64]),
        "jaxdist_watchdog_stop": (None, []),
        "jaxdist_watchdog_check": (None, []),
        "jaxdist_watchdog_trip": (None, [c.c_char_p]),
        "jaxdist_watchdog_failure": (c.c_int64, [c.c_char_p, c.c_int64]),
        "jaxdist_flight_record": (c.c_int64, [c.c_int, c.c_char_p, c.c_int64]),
        "jaxdist_flight_set_step": (None, [c.c_int64]),
        "jaxdist_flight_set_process": (None, [c.c_int]),
        "jaxdist_flight_set_enabled": (None, [c.c_int]),
        "jaxdist_test_issue": (
            c.c_int,
            [c.c_int64, c.c_int, c.c_int, c.c_int64, c.c_int, c.c_int, c.c_char_p, c.c_int],
        ),
        "jaxdist_test_issue_group": (
            c.c_int,
            [c.c_int64, c.c_int, c.c_int, c.c_int64, c.c_int, c.c_char_p, c.c_int],
        ),
    }
    missing = [name for name in sig if not hasattr(lib, name)]
    if missing:
        raise NativeLibraryError(
            f"jaxdist's FFI library {lib._name} is older than this jaxdist (it lacks {', '.join(missing)}); "
            f"rebuild it (`pip install -e .`, or CMake on ffi/ and ${LIBRARY_ENV})"
        )
    for name, (restype, argtypes) in sig.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


def read_string(fn_name: str, *args) -> str:
    """Call a C entry point that copies a string into a trailing (buf, len) pair and returns its length."""
    fn = getattr(ffi_library(), fn_name)
    n = fn(*args, None, 0)
    while True:  # the string may grow between the calls
        buf = ctypes.create_string_buffer(n + 1)
        m = fn(*args, buf, n + 1)
        if m <= n:
            return buf.value.decode(errors="replace")
        n = m


def call(fn_name: str, *args) -> None:
    """Call a C entry point that reports failure through a trailing (buf, len) pair."""
    err = ctypes.create_string_buffer(2048)
    if getattr(ffi_library(), fn_name)(*args, err, len(err)) != 0:
        raise RuntimeError(err.value.decode(errors="replace"))
