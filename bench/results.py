"""Append a benchmark's table to bench/RESULTS.md with the date, git commit, device and command."""

import datetime
import subprocess
from pathlib import Path

RESULTS = Path(__file__).parent / "RESULTS.md"


def append_result(title: str, command: str, device: str, table: str) -> None:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=RESULTS.parent, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=RESULTS.parent
        ).stdout.strip()
        commit += " (with uncommitted changes)" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    date = datetime.date.today().isoformat()
    block = f"\n## {title} ({date})\n\n{date}, commit {commit}, {device}, command `{command}`\n\n{table}\n"
    with RESULTS.open("a") as f:
        f.write(block)
