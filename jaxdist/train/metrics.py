"""`metrics.jsonl`: one JSON object per line, one row per logged step, readable by any JSON parser.

Each row goes to the file in one `write` of the complete line (`O_APPEND`), so a crash leaves at
most the last row cut short, never two rows mixed; a write that fails (a full disk) is cut back to
the rows before it. A value that is not finite (a NaN or infinite loss) is written as `null`, since
JSON has no NaN; a metric the run does not compute is left out of the row. Readers (a resume,
`jaxdist plot`) drop a cut-short last row, and skip a damaged row elsewhere, with a one-line
warning naming the file and line.
"""

from __future__ import annotations

import errno
import json
import math
import numbers
import os
from collections.abc import Callable
from pathlib import Path

from jaxdist.train.report import disk_full, write_problem

FILE = "metrics.jsonl"


class MetricsError(RuntimeError):
    """A metrics row could not be written; the message is one line and names the fix."""


def _json_value(value):
    """`value` as JSON takes it: numbers as int / float, non-finite floats as None."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value) if math.isfinite(value) else None
    return value


def encode_row(row: dict) -> str:
    """The line of `row` (with its newline): strict JSON, non-finite values as null."""
    return json.dumps({k: _json_value(v) for k, v in row.items()}, allow_nan=False) + "\n"


def _parse_row(line: str) -> dict:
    """The row of one line (a bare NaN, as an older jaxdist wrote, read as null), or ValueError saying why it
    is not one."""
    row = json.loads(line)
    step = row.get("step") if isinstance(row, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        raise ValueError("it has no integer step")
    return {k: _json_value(v) for k, v in row.items()}


def read_rows(path: Path, warn: Callable[[str], None]) -> list[dict]:
    """The rows of `path` (none if it does not exist); a damaged row is left out, with a warning via `warn`."""
    if not path.is_file():
        return []
    lines = path.read_bytes().decode("utf-8", errors="replace").split("\n")
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    rows = []
    for n, line in numbered:
        try:
            rows.append(_parse_row(line))
        except ValueError as e:
            reason = str(e).splitlines()[0]
            if n == numbered[-1][0]:
                warn(f"the last row of {path} (line {n}) is incomplete ({reason}), a write cut short; dropped it")
            else:
                warn(f"line {n} of {path} is not a metrics row ({reason}); skipped it")
    return rows


def rewrite(path: Path, rows: list[dict]) -> None:
    """Replace `path` with `rows`, atomically: a crash leaves the old file or the new one."""
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text("".join(encode_row(r) for r in rows))
    os.replace(tmp, path)


class RowWriter:
    """Appends rows to `path`, each in one write of its complete line."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def write(self, row: dict) -> None:
        data = encode_row(row).encode()
        size = os.fstat(self.fd).st_size
        try:
            written = os.write(self.fd, data)
            if written != len(data):  # the disk filled mid-row: what did not fit is the error
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            try:
                os.ftruncate(self.fd, size)  # no half row left behind
            except OSError:
                pass
            hint = "free some space" if disk_full(e) else "fix the cause"
            raise MetricsError(
                f"could not write the metrics of step {row.get('step')} to {self.path}: "
                f"{write_problem(e, self.path.parent)}; {hint} and run again to resume from the last checkpoint"
            ) from None

    def close(self) -> None:
        os.close(self.fd)
