"""Installing accel as a user does: by its distribution name, from a checkout, into a fresh venv.

The fresh venvs have no pip and no packages of their own; their one `.pth` file points at a
folder of links to this environment's installed packages minus accel itself, so the installs
below resolve every dependency (and the `tensorboard` extra) offline, and accel is only what the
install under test puts there. Each import runs from the folder that holds the checkout, which is
named `accel`: Python sees that folder as an empty namespace package `accel` on the current
directory, and the install must still win.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import accel
from tests.cli.test_cli import _env

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTION = "accel-train"  # `pip install accel` is an unrelated package on the index
PROBE = (
    "import importlib.metadata as m, accel; accel.init_distributed; "
    f"print(accel.__file__); print(m.version({DISTRIBUTION!r}))"
)

pytestmark = pytest.mark.slow


def _checkout(parent: Path, *, everything: bool = False) -> Path:
    """A copy of what a clone holds for packaging, in a folder named `accel` under `parent`;
    with `everything`, also the folders beside the package and the Makefile."""
    checkout = parent / "accel"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    folders = ("accel", "accel_cli", "accel_settings")  # the library, the command, their table
    files = ("pyproject.toml", "README.md", "LICENSE")
    if everything:
        folders += ("tests", "tools", "examples", "benchmarks")
        files += ("Makefile", "constraints.txt")
    for folder in folders:
        shutil.copytree(ROOT / folder, checkout / folder, ignore=ignore)
    for name in files:
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


def _isolated() -> dict[str, str]:
    """This environment minus PYTHONPATH, which would put a checkout on the venv's path."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _probe(python: Path, cwd: Path) -> list[str]:
    run = subprocess.run(
        [str(python), "-c", PROBE], capture_output=True, text=True, timeout=300, cwd=cwd,
        env=_isolated(),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.split()


def test_a_development_install_imports_the_checkout_from_its_parent_folder(
    tmp_path: Path,
) -> None:
    checkout = _checkout(tmp_path)
    python = _fresh_venv(tmp_path / "venv", _dependencies(tmp_path / "deps"))
    _pip(python, "--no-deps", "--editable", str(checkout))
    where, version = _probe(python, cwd=tmp_path)
    # A link to the checkout's file (pyproject.toml's editable mode): edits show at once.
    assert Path(where).resolve() == checkout / "accel" / "__init__.py"
    assert version == accel.__version__


def test_a_development_install_makes_only_accel_importable(tmp_path: Path) -> None:
    """The checkout's own tests/, tools/, examples/ and benchmarks/ must not import from
    everywhere in the venv, where they shadowed a user's `tests` package (issue 37 item 10)."""
    checkout = _checkout(tmp_path, everything=True)
    python = _fresh_venv(tmp_path / "venv", _dependencies(tmp_path / "deps"))
    _pip(python, "--no-deps", "--editable", str(checkout))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = (
        "import importlib.util as u, accel, accel_cli; "
        "print([n for n in ('tests', 'tools', 'examples', 'benchmarks') if u.find_spec(n)])"
    )
    run = subprocess.run(
        [str(python), "-c", probe], capture_output=True, text=True, timeout=300, cwd=elsewhere,
        env=_isolated(),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[]", f"importable from the checkout: {run.stdout}"


def _readme_install_lines() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Install") :]
    block = re.search(r"^```bash\n(.*?)^```", section, re.S | re.M)
    assert block is not None, "README's Install section has no bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def _venv_with_pip(folder: Path, deps: Path) -> Path:
    """A fresh venv whose `pip` command is this environment's pip (linked with the rest)."""
    python = _fresh_venv(folder, deps)
    pip = folder / "bin" / "pip"
    pip.write_text(f"#!{python}\nimport sys\nfrom pip._internal.cli.main import main\n"
                   "sys.exit(main())\n")  # fmt: skip
    pip.chmod(0o755)
    return python


def test_the_readme_install_lines_run_as_written(tmp_path: Path) -> None:
    """Each line of README's install block, run by bash in the checkout's folder as written:
    each `pip install` into a fresh venv, `make dist` with the venv's python. Offline: the
    venvs link this environment's packages (torch included), pip uses no index and builds
    with the installed setuptools; the wheel's install then passes `accel test`."""
    lines = _readme_install_lines()
    assert [line.split("#")[0].split()[:2] for line in lines] == [
        ["pip", "install"], ["pip", "install"], ["make", "dist"], ["pip", "install"],
    ]  # fmt: skip
    checkout = _checkout(tmp_path, everything=True)
    deps = _dependencies(tmp_path / "deps")
    python = None
    for i, line in enumerate(lines):
        if line.startswith("pip"):
            python = _venv_with_pip(tmp_path / f"venv{i}", deps)
        assert python is not None
        env = {
            **_isolated(),
            "PATH": f"{python.parent}{os.pathsep}{os.environ['PATH']}",
            "VIRTUAL_ENV": str(python.parent.parent),
            "PIP_NO_INDEX": "1",
            "PIP_NO_BUILD_ISOLATION": "0",  # pip's own reading: 0 turns isolation off
            "MAKEFLAGS": f"PY={python} BUILD_FLAGS=--no-isolation",
        }
        run = subprocess.run(
            ["bash", "-euc", line], cwd=checkout, env=env, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        assert run.returncode == 0, f"{line}\n{run.stdout[-3000:]}{run.stderr[-3000:]}"
        if line.startswith("make dist"):
            built = sorted(p.name for p in (checkout / "dist").iterdir())
            version = accel.__version__
            assert built == [f"accel_train-{version}-py3-none-any.whl",
                             f"accel_train-{version}.tar.gz"]  # fmt: skip
            continue
        where, version = _probe(python, cwd=tmp_path)
        assert version == accel.__version__
        editable = "-e" in line.split()
        site = Path(sysconfig.get_paths(vars={"base": str(python.parent.parent)})["purelib"])
        assert Path(where).resolve() == (checkout if editable else site) / "accel" / "__init__.py"
        if i == 0:  # `accel env` names the distribution and where accel was imported from
            env_run = subprocess.run(
                [str(python.parent / "accel"), "env"],
                capture_output=True, text=True, timeout=300, cwd=tmp_path, env=_isolated(),
            )  # fmt: skip
            assert env_run.returncode == 0, env_run.stderr
            expected = f"- accel ({DISTRIBUTION}): {accel.__version__}, imported from {where}"
            assert expected in env_run.stdout
    # The wheel, installed without the checkout, runs accel's own check of the world.
    check = subprocess.run(
        [str(python.parent / "accel"), "test"],
        env={k: v for k, v in _env(tmp_path).items() if k != "PYTHONPATH"},
        capture_output=True, text=True, timeout=300,
        cwd=tmp_path,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr[-3000:]


@pytest.mark.slow
def test_make_dist_builds_both_files_quietly(tmp_path: Path) -> None:
    """Issue 44 item 9: `make dist` printed setuptools' deprecation of `project.license` as a
    table four times (it stops building after 2027-02-18) in 686 lines."""
    checkout = _checkout(tmp_path)
    shutil.copy(ROOT / "Makefile", checkout / "Makefile")
    run = subprocess.run(
        ["make", "--no-print-directory", "dist", f"PY={sys.executable}",
         "BUILD_FLAGS=--no-isolation"],
        cwd=checkout, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    log = (checkout / "build" / "dist.log").read_text()  # build's own lines, kept for a failure
    assert "eprecat" not in output + log, log[-3000:]  # no deprecation of any kind, even hidden
    assert len(output.splitlines()) <= 10, output[-3000:]
    version = accel.__version__
    assert sorted(p.name for p in (checkout / "dist").iterdir()) == [
        f"accel_train-{version}-py3-none-any.whl", f"accel_train-{version}.tar.gz"
    ]  # fmt: skip
