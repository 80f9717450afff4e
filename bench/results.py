"""Append a benchmark's table to bench/RESULTS.md with the date, git commit, device and command."""

import datetime
import json
import os
import subprocess
from pathlib import Path

RESULTS = Path(__file__).parent / "RESULTS.md"


def append_result(title: str, command: str, device: str, table: str) -> None:
    # a copied working tree (a GPU runner) may carry a stale .git: JAXDIST_COMMIT says which commit it is
    if os.environ.get("JAXDIST_COMMIT"):
        commit = os.environ["JAXDIST_COMMIT"]
    else:
        commit = _git_commit()
    date = datetime.date.today().isoformat()
    block = f"\n## {title} ({date})\n\n{date}, commit {commit}, {device}, command `{command}`\n\n{table}\n"
    with RESULTS.open("a") as f:
        f.write(block)


def _git_commit() -> str:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=RESULTS.parent, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=RESULTS.parent
        ).stdout.strip()
        return commit + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_child(cmd: list[str], timeout: float, marker: str) -> dict:
    """Run one benchmark configuration in its own process: the JSON after `marker` on its last such
    stdout line, or {"error": ...} with its exit code and last stderr line (or the timeout)."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(marker):
            return json.loads(line[len(marker) :])
    tail = [line for line in done.stderr.splitlines() if line.strip()] or [""]
    return {"error": f"exit code {done.returncode}: {tail[-1]}"[:200]}
