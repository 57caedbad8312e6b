"""`make test` and `make test-fast`: a run that collects no test fails the target.

pytest exits with code 5 when it collects nothing (a wrong path, a marker expression that
deselects everything); a target that let that pass would report a green suite that never ran.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("target", ["test", "test-fast"])
def test_a_run_that_collects_no_test_fails_the_target(tmp_path: Path, target: str) -> None:
    empty = f"{sys.executable} -m pytest -p no:cacheprovider {tmp_path}"  # no test in it
    run = subprocess.run(
        # NO_INSTALL: take the installed .venv as it is, never reinstall it from a test
        ["make", "--no-print-directory", target, "NO_INSTALL=1", f"PYTEST={empty}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "no tests ran" in run.stdout, run.stdout + run.stderr  # pytest ran, collected nothing
    assert run.returncode != 0, f"make {target} passed a run with no test:\n{run.stdout}"


def _dry_run(tmp_path: Path, target: str) -> str:
    """`make -n target` in a copy of the checkout's build files, no .venv: what it would run."""
    copy = tmp_path / target
    for folder in ("accel", "accel_cli"):
        shutil.copytree(ROOT / folder, copy / folder)
    for name in ("Makefile", "pyproject.toml", "constraints.txt"):
        shutil.copy(ROOT / name, copy / name)
    run = subprocess.run(
        ["make", "--no-print-directory", "-n", target], cwd=copy, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_make_demo_installs_the_demo_extra_and_builds_nothing_else(tmp_path: Path) -> None:
    """It installed the dev extra (168 packages) and built DeepSpeed's op (132 s), which the
    demo never uses: 5 min 44 s from a fresh clone (issue 37 item 6)."""
    demo = _dry_run(tmp_path, "demo")
    assert "-e '.[demo]'" in demo
    assert "[dev]" not in demo and "deepspeed" not in demo, demo
    test = _dry_run(tmp_path, "test")
    assert "-e '.[dev]'" in test and "deepspeed-ops" in test


def test_the_demo_extra_holds_what_the_demo_imports() -> None:
    try:
        import tomllib
    except ImportError:  # Python 3.10: pip's own copy of the same parser
        from pip._vendor import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {
        re.split(r"[<>=\[ ]", req)[0].lower()
        for req in [*project["dependencies"], *project["optional-dependencies"]["demo"]]
    }
    tree = ast.parse((ROOT / "examples" / "char_lm.py").read_text())
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
        for alias in node.names
    } | {node.module.split(".")[0] for node in ast.walk(tree)
         if isinstance(node, ast.ImportFrom) and node.module}  # fmt: skip
    third_party = imported - set(sys.stdlib_module_names) - {"__future__", "accel"}
    assert third_party == {"torch", "matplotlib"}
    assert third_party <= names, f"{sorted(third_party - names)} missing from the demo extra"
