"""The repository's root holds what DESIGN.md's Layout section names, and running the suite adds
nothing there (issue 37 item 11: `--collect-only/0.json` and `-q/0.json` were committed after
pytest's doctest collection imported tests/cli/trainer_script.py, which trained a Trainer into
the folder named by pytest's own first argument)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# DESIGN.md's Layout, plus the files every checkout has beside it.
LAYOUT = frozenset({
    "pyproject.toml", "README.md", "Makefile", ".ci", "accel", "tests", "examples", "benchmarks",
    "docs", "accel_cli", "accel_settings", "tools", "LICENSE", "CHANGELOG.md", "constraints.txt",
    ".gitignore",
})  # fmt: skip


def _git(*argv: str) -> list[str]:
    run = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60)
    if run.returncode != 0:
        pytest.skip(f"not a git checkout: {run.stderr.strip()}")  # an unpacked sdist
    return run.stdout.splitlines()


def _top(paths: list[str]) -> set[str]:
    return {p.split("/", 1)[0] for p in paths if p}


def test_the_root_tracks_only_what_the_layout_names() -> None:
    tracked = _top(_git("ls-files", "--full-name", "."))
    assert tracked - LAYOUT == set(), "tracked at the root but not in DESIGN.md's Layout"
    assert {"accel", "tests", "pyproject.toml"} <= tracked


def test_the_root_holds_no_untracked_output() -> None:
    """Whatever the suite (or its collection, which runs before this test) writes at the root
    is either ignored by .gitignore (runs/, build/, ...) or a defect."""
    untracked = _top(_git("ls-files", "--others", "--exclude-standard", "--directory", "."))
    assert untracked - LAYOUT == set(), "untracked files at the root: output of a test or tool?"


@pytest.mark.slow
def test_collecting_the_trainer_script_writes_nothing(tmp_path: Path) -> None:
    """`--doctest-modules` imports every module under tests/, scripts included."""
    script = ROOT / "tests" / "cli" / "trainer_script.py"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "--rootdir", str(ROOT), str(script)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 5, run.stdout + run.stderr  # collected (imported), no test in it
    assert sorted(p.name for p in tmp_path.iterdir()) == []
