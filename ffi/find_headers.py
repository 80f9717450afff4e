"""Print the include directories the FFI library builds against, ';'-separated.

XLA FFI headers come from jaxlib; NCCL's from the nvidia-nccl-cu12/-cu13
wheel; the CUDA driver API header (cuda.h) from a CUDA runtime wheel or a CUDA toolkit.
$JAXDIST_NCCL_INCLUDE and $JAXDIST_CUDA_INCLUDE override the search.
"""

import importlib.util
import os
import sys
from pathlib import Path


def nvidia_dirs(sub: str) -> list[Path]:
    """`nvidia/<...>/include` folders of the installed nvidia-* wheels that hold `sub`."""
    spec = importlib.util.find_spec("nvidia")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    return [inc for root in roots for inc in sorted(root.glob("*/include")) if (inc / sub).exists()]


def first(candidates: list[Path], what: str, hint: str) -> Path:
    for c in candidates:
        if c.exists():
            return c
    sys.exit(f"jaxdist: no {what} found; {hint}")


def main() -> None:
    import jax.ffi

    xla = Path(jax.ffi.include_dir())
    nccl = first(
        [Path(os.environ["JAXDIST_NCCL_INCLUDE"])] if "JAXDIST_NCCL_INCLUDE" in os.environ else nvidia_dirs("nccl.h"),
        "nccl.h",
        "pip install nvidia-nccl-cu12 (or -cu13), or set JAXDIST_NCCL_INCLUDE",
    )
    cuda_candidates = [Path(os.environ["JAXDIST_CUDA_INCLUDE"])] if "JAXDIST_CUDA_INCLUDE" in os.environ else []
    cuda_candidates += nvidia_dirs("cuda.h")
    cuda_candidates += [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"]
    cuda = first(
        [c for c in cuda_candidates if (c / "cuda.h").exists()],
        "cuda.h (the CUDA driver API header)",
        "pip install nvidia-cuda-runtime-cu12, install a CUDA toolkit, or set JAXDIST_CUDA_INCLUDE",
    )
    print(";".join(str(p) for p in dict.fromkeys([xla, nccl, cuda])))


if __name__ == "__main__":
    main()
