"""Installing accel as a user does: by its distribution name, from a checkout, into a fresh venv.

The fresh venvs have no pip and no packages of their own; their one `.pth` file points at a
folder of links to this environment's installed packages minus accel itself, so the installs
below resolve every dependency (and the `tensorboard` extra) offline, and accel is only what the
install under test puts there. Each import runs from the folder that holds the checkout, which is
named `accel`: Python sees that folder as an empty namespace package `accel` on the current
directory, and the install must still win.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import accel

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTION = "accel-train"  # `pip install accel` is an unrelated package on the index
PROBE = (
    "import importlib.metadata as m, accel; accel.init_distributed; "
    f"print(accel.__file__); print(m.version({DISTRIBUTION!r}))"
)

pytestmark = pytest.mark.slow


def _checkout(parent: Path) -> Path:
    """A copy of what a clone holds for packaging, in a folder named `accel` under `parent`."""
    checkout = parent / "accel"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for package in ("accel", "accel_cli"):  # the library, and the command's torch-free parser
        shutil.copytree(ROOT / package, checkout / package, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, checkout / name)
    return checkout


def _fresh_venv(folder: Path, deps: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(site) / "_dependencies.pth").write_text(f"{deps}\n")
    return python


def _dependencies(folder: Path) -> Path:
    """Links to every installed package of this environment except accel's own files."""
    folder.mkdir()
    sites = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    for site in sites:
        for entry in Path(site).iterdir():
            own = entry.name.startswith(("accel", "__editable__")) or entry.suffix == ".pth"
            if not own and not (folder / entry.name).exists():
                (folder / entry.name).symlink_to(entry)
    return folder


def _pip(python: Path, *argv: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
         "--no-build-isolation", "--quiet", *argv],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr


def _probe(python: Path, cwd: Path) -> list[str]:
    run = subprocess.run(
        [str(python), "-c", PROBE], capture_output=True, text=True, timeout=300, cwd=cwd
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.split()


def test_the_readme_install_line_installs_accel_by_its_name(tmp_path: Path) -> None:
    checkout = _checkout(tmp_path)
    python = _fresh_venv(tmp_path / "venv", _dependencies(tmp_path / "deps"))
    _pip(python, f"{checkout}[tensorboard]")  # README: pip install '.[tensorboard]'
    site = Path(sysconfig.get_paths(vars={"base": str(tmp_path / "venv")})["purelib"])
    where, version = _probe(python, cwd=tmp_path)  # tmp_path holds the checkout `accel/`
    assert (Path(where), version) == (site / "accel" / "__init__.py", accel.__version__)
    env = subprocess.run(
        [str(tmp_path / "venv" / "bin" / "accel"), "env"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert env.returncode == 0, env.stderr
    assert f"- accel ({DISTRIBUTION}): {accel.__version__}, imported from {where}" in env.stdout


def test_a_development_install_imports_the_checkout_from_its_parent_folder(
    tmp_path: Path,
) -> None:
    checkout = _checkout(tmp_path)
    python = _fresh_venv(tmp_path / "venv", _dependencies(tmp_path / "deps"))
    _pip(python, "--no-deps", "--editable", str(checkout))
    where, version = _probe(python, cwd=tmp_path)
    assert (Path(where), version) == (checkout / "accel" / "__init__.py", accel.__version__)
