"""The `tokenizing` progress of data preparation follows the trainer's rule: a bar on a terminal, plain
lines (no carriage-return frames) in a log file or a pipe."""

import io
import os
import subprocess
import sys
from pathlib import Path

from jaxdist.train.data import prepare

REPO = Path(__file__).resolve().parents[3]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _text(tmp_path) -> Path:
    path = tmp_path / "in.txt"
    path.write_text("a line of text\n" * 2000)  # 30 kB
    return path


def test_without_a_terminal_tokenizing_progress_is_plain_lines(tmp_path, monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    monkeypatch.setattr(prepare, "PLAIN_EVERY_S", 0.0)  # a line at every update, to see several
    monkeypatch.setattr(prepare, "CHUNK_BYTES", 1 << 12)
    monkeypatch.setattr(prepare, "ENCODE_BATCH", 1)
    prepare.prepare([_text(tmp_path)], tmp_path / "data", progress=True)
    out = log.getvalue()
    assert "\r" not in out and "\x1b" not in out
    lines = out.splitlines()
    assert len(lines) > 2 and all(line.startswith("tokenizing: ") for line in lines)
    assert lines[-1] == "tokenizing: 30.0kB of 30.0kB (100%)"


def test_on_a_terminal_tokenizing_progress_is_a_bar(tmp_path, monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    prepare.prepare([_text(tmp_path)], tmp_path / "data", progress=True)
    assert "\r" in terminal.getvalue() and "tokenizing" in terminal.getvalue()


def test_the_cli_piped_to_a_file_writes_no_bar_frames(tmp_path):
    text, out = str(_text(tmp_path)), str(tmp_path / "d")
    cmd = [sys.executable, "-m", "jaxdist.train.cli", "prepare-data", text, "--out", out]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr and "tokenizing: 30.0kB of 30.0kB (100%)" in done.stderr
