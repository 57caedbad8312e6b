"""The first commands a newcomer types (issue 44 items 6 and 8): `--version`, every `--help`
through `python -m accel` too, without torch; output piped into `head` ends quietly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from accel._version import __version__
from tests.cli.test_cli import _env

COMMANDS = ("config", "launch", "env", "test", "estimate-memory", "merge-weights")


def _python(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], env=_env(tmp_path), capture_output=True, text=True, timeout=180,
        cwd=tmp_path,
    )  # fmt: skip


@pytest.mark.parametrize("argv", [["--help"], ["--version"], *([c, "--help"] for c in COMMANDS)])
def test_python_m_accel_answers_help_and_version_without_torch(
    tmp_path: Path, argv: list[str]
) -> None:
    """`python -m accel` imports the accel package before its __main__, and the package
    imported torch (1.6 s idle), where `accel --help` answers in 31 ms."""
    out = _python(tmp_path, "-X", "importtime", "-m", "accel", *argv)
    assert out.returncode == 0, out.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert "torch" not in imported, sorted(m for m in imported if m.startswith("torch"))[:5]
    assert out.stdout.startswith("usage:") or out.stdout == f"accel {__version__}\n"


def test_accel_version_names_the_version(tmp_path: Path) -> None:
    out = _python(tmp_path, "-c", "import accel_cli; accel_cli.main(['--version'])")
    assert (out.returncode, out.stdout, out.stderr) == (0, f"accel {__version__}\n", "")


@pytest.mark.parametrize("argv", [["env"], ["config", "--show"]])
def test_output_into_a_closed_pipe_ends_quietly(tmp_path: Path, argv: list[str]) -> None:
    """`accel env | head` printed "Broken pipe" and exited 2: a reader that stops reading is
    no error of the command's; it stops, silently, as Unix tools do."""
    process = subprocess.Popen(
        [sys.executable, "-m", "accel", *argv], env=_env(tmp_path), cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # `head` is done before anything was written
    err = process.stderr.read()
    process.stderr.close()
    assert process.wait(timeout=180) == 141, err  # 128 + SIGPIPE: what a shell shows for cat
    assert err == ""
