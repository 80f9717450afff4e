"""One-line messages to the user, printed once per run (by process 0)."""

from __future__ import annotations

import sys

import jax


def info(message: str) -> None:
    if jax.process_index() == 0:
        print(f"jaxdist: {message}", flush=True)


def warn(message: str) -> None:
    if jax.process_index() == 0:
        print(f"jaxdist: warning: {message}", file=sys.stderr, flush=True)
