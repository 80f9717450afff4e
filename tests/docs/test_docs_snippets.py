"""Every Python snippet of the README and the documentation pages runs as written.

Each page's ```python blocks run in order, in one fresh interpreter per page (8 simulated CPU
devices, the checkout on the path, a scratch working directory), so a snippet may use what an
earlier block of its page defined, and nothing leaks between pages. A page whose snippets fail
fails its test with the interpreter's output. A block right after a line
`<!-- snippet: run by tests/FILE.py ... -->` needs what only that test makes (e.g. a real export):
that test runs it, and this one checks that the test exists and names the page.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
# a ```python block, and the dedicated test named by a `<!-- snippet: run by tests/X.py -->` line before it
FENCE = re.compile(
    r"^(?:<!-- snippet: run by (tests/\S+\.py)[^>]*-->\n)?```python\n(.*?)^```", re.DOTALL | re.MULTILINE
)


def python_blocks(page: Path) -> list[str]:
    """The page's Python snippets this test runs (those no dedicated test runs)."""
    return [code for runner, code in FENCE.findall(page.read_text()) if not runner]


def dedicated_runners(page: Path) -> list[str]:
    return [runner for runner, _ in FENCE.findall(page.read_text()) if runner]


PAGES_WITH_CODE = [p for p in PAGES if python_blocks(p)]


def test_snippet_extraction_finds_the_pages_with_code():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES_WITH_CODE}
    assert {"docs/getting-started.md", "docs/guides/engine.md", "docs/comm.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_snippets_left_to_a_dedicated_test_are_run_by_it(page: Path):
    for runner in dedicated_runners(page):
        assert page.relative_to(ROOT).as_posix() in (ROOT / runner).read_text(), f"{runner} does not read {page.name}"


# pages whose snippets train what a fast test trains too (the pipeline, the model families, context
# parallelism: tests/pipeline, tests/models, tests/cp) run with the slow tests; CI runs every page
SLOW_PAGES = {"docs/guides/pipeline.md", "docs/models.md", "docs/guides/context-parallel.md"}


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(
            p,
            id=p.relative_to(ROOT).as_posix(),
            marks=pytest.mark.slow if p.relative_to(ROOT).as_posix() in SLOW_PAGES else (),
        )
        for p in PAGES_WITH_CODE
    ],
)
def test_page_snippets_run(page: Path, tmp_path):
    script = tmp_path / "snippets.py"
    script.write_text("\n\n".join(python_blocks(page)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env.setdefault("JAX_PLATFORMS", "cpu")
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{page.name}'s snippets failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
