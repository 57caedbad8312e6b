"""`make test` and `make test-fast`: a run that collects no test fails the target.

pytest exits with code 5 when it collects nothing (a wrong path, a marker expression that
deselects everything); a target that let that pass would report a green suite that never ran.
"""

from __future__ import annotations

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
        # -o: take the installed .venv as it is, never reinstall it from a test
        ["make", "--no-print-directory", "-o", ".venv/.installed", target, f"PYTEST={empty}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "no tests ran" in run.stdout, run.stdout + run.stderr  # pytest ran, collected nothing
    assert run.returncode != 0, f"make {target} passed a run with no test:\n{run.stdout}"
