"""Every ```python block in docs/ and README.md runs, and every relative link resolves.

The blocks of one file run in one subprocess (so torch is imported once per file), each in a
fresh namespace and in a temporary working directory; a failure names the file and line.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)

RUNNER = """
import json, sys, traceback
blocks = json.load(open(sys.argv[1]))
for line, code in blocks:
    try:
        exec(compile(code, f"{sys.argv[2]}:{line}", "exec"), {"__name__": "__docs__"})
    except BaseException:
        print(f"block at {sys.argv[2]}:{line} failed:\\n{traceback.format_exc()}", file=sys.stderr)
        sys.exit(1)
"""


def python_blocks(page: Path) -> list[tuple[int, str]]:
    text = page.read_text()
    return [
        (text.count("\n", 0, m.start()) + 2, m.group(2))
        for m in FENCE.finditer(text)
        if m.group(1) == "python"
    ]


def test_the_docs_have_code_to_run() -> None:
    assert sum(len(python_blocks(p)) for p in PAGES) >= 5


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_python_blocks_run(page: Path, tmp_path: Path) -> None:
    blocks = tmp_path / "blocks.json"
    blocks.write_text(json.dumps(python_blocks(page)))
    run = subprocess.run(
        [sys.executable, "-c", RUNNER, str(blocks), str(page.relative_to(ROOT))],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    text = FENCE.sub("", page.read_text())
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
