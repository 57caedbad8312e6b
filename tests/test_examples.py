"""Every example runs a few steps under `accel launch` at 2 CPU processes, as its docstring says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_cli import accel_cli

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# Example -> (arguments for a short run, a line its output must contain).
SMOKE = {
    "train_minimal.py": (["--steps", "20"], r"\[rank 0\] step 20 loss (\d+\.\d+)"),
    "one_piece.py": (["--epochs", "1"], r"epoch 0 accuracy \d\.\d+ on 200 samples"),
    "test_my_step.py": ([], r"\[rank 1\] parameters after 3 steps"),
}


def test_every_example_has_a_smoke_run_and_a_launch_command() -> None:
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert scripts, "no examples found"
    assert sorted(SMOKE) == scripts, "add each new example to SMOKE"
    for name in scripts:
        doc = (EXAMPLES / name).read_text()
        assert f"accel launch --num_processes 2 examples/{name}" in doc, name


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_example_runs_on_two_processes(tmp_path: Path, name: str) -> None:
    argv, expected = SMOKE[name]
    result = accel_cli(tmp_path, "launch", "--num_processes", "2", str(EXAMPLES / name), *argv)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(expected, result.stdout + result.stderr), result.stdout + result.stderr


def test_train_minimal_learns_in_one_process(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_minimal.py"), "--steps", "40"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", run.stderr + run.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0] / 4, losses


def test_the_users_pytest_example_passes() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_my_step.py"],
        capture_output=True, text=True, timeout=300, cwd=EXAMPLES,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 passed" in run.stdout
