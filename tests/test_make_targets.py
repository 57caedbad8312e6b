"""`make test` and `make test-fast`: a run that collects no test fails the target; a failed
run ends with the failed tests' names and last lines. `make flake`: reruns and keeps failures.
`make gpu-check`: its dry run writes every part into summary.json.

pytest exits with code 5 when it collects nothing (a wrong path, a marker expression that
deselects everything); a target that let that pass would report a green suite that never ran.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _own_project(folder: Path) -> None:
    """Give the sample tests a pytest configuration of their own, as a project has: without one,
    pytest roots them at the common ancestor of the checkout and the folder (/tmp for a clone in
    /tmp, failing in a fresh-clone run), and the report's names carry the path from there."""
    (folder / "pytest.ini").write_text("[pytest]\n")


@pytest.mark.slow
@pytest.mark.parametrize("target", ["test", "test-fast"])
def test_a_run_that_collects_no_test_fails_the_target(tmp_path: Path, target: str) -> None:
    empty = f"{sys.executable} -m pytest -p no:cacheprovider {tmp_path}"  # no test in it
    run = subprocess.run(
        # NO_INSTALL: take the installed .venv as it is, never reinstall it from a test
        ["make", "--no-print-directory", target, "NO_INSTALL=1", f"PYTEST={empty}",
         f"REPORT={tmp_path / 'report.xml'}"],  # not the report of the run this test is in
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "no tests ran" in run.stdout, run.stdout + run.stderr  # pytest ran, collected nothing
    assert run.returncode != 0, f"make {target} passed a run with no test:\n{run.stdout}"


FAILING = """
import sys


def test_passes():
    print("quiet success")


def test_fails_after_printing():
    for i in range(100):
        print(f"progress line {i}")
    print("the last words" + " on stderr", file=sys.stderr)  # in the summary only if printed
    assert 1 + 1 == 3, "arithmetic broke"
"""


def _own_project(folder: Path) -> None:
    """Give the sample tests a pytest configuration of their own, as a project has: without one,
    pytest roots them at the common ancestor of the checkout and the folder (/tmp for a clone in
    /tmp, failing in a fresh-clone run), and the report's names carry the path from there."""
    (folder / "pytest.ini").write_text("[pytest]\n")


@pytest.mark.slow
@pytest.mark.parametrize("target", ["test", "test-fast"])
def test_a_failed_run_ends_with_the_failed_tests_and_their_last_lines(
    tmp_path: Path, target: str
) -> None:
    (tmp_path / "test_sample.py").write_text(FAILING)
    _own_project(tmp_path)
    sample = f"{sys.executable} -m pytest -p no:cacheprovider {tmp_path}"
    run = subprocess.run(
        ["make", "--no-print-directory", target, "NO_INSTALL=1", f"PYTEST={sample}",
         f"PY={sys.executable}", f"REPORT={tmp_path / 'report.xml'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0, run.stdout
    # What follows pytest's own output: the failed test's name, its error, what it printed last.
    summary = run.stdout.split("1 failed test(s):", 1)[1]
    assert summary.splitlines()[1].strip() == "FAILURE test_sample::test_fails_after_printing"
    assert "AssertionError: arithmetic broke" in summary
    stdout, stderr = summary.split("its stdout, last lines:")[1].split("its stderr, last lines:")
    assert "progress line 99" in stdout and "progress line 10\n" not in stdout  # the tail
    assert stderr.split() == ["the", "last", "words", "on", "stderr"]
    assert "test_passes" not in summary and "quiet success" not in summary


FLAKY = """
from pathlib import Path

RUNS = Path(__file__).with_name("runs")


def test_fails_every_second_run(tmp_path):
    n = len(RUNS.read_text()) if RUNS.exists() else 0
    RUNS.write_text("x" * (n + 1))
    print(f"this is run {n}")
    (tmp_path / "left.txt").write_text(str(n))
    assert n % 2 == 0, f"run {n} is odd"
"""


@pytest.mark.slow
def test_make_flake_reruns_a_test_and_keeps_each_failure(tmp_path: Path) -> None:
    (tmp_path / "test_flaky.py").write_text(FLAKY)
    _own_project(tmp_path)
    out = tmp_path / "out"
    run = subprocess.run(
        ["make", "--no-print-directory", "flake", "NO_INSTALL=1", f"PY={sys.executable}",
         f"TESTS={tmp_path / 'test_flaky.py'}", "N=3", f"FLAKE_OUT={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode != 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("run-")] == [
        "run-000", "run-001", "run-002",
    ]  # fmt: skip
    assert "run-001: FAILED, exit code 1" in run.stdout
    assert "3 runs (load: none)" in run.stdout and ": 1 failed" in run.stdout
    report = run.stdout.split("===== run-001", 1)[1]
    assert "FAILURE test_flaky::test_fails_every_second_run" in report
    assert "AssertionError: run 1 is odd" in report and "this is run 1" in report
    assert "this is run 1" in (out / "run-001.log").read_text()  # the whole output, kept
    # A failed run's temporary folders are kept for a look; a passed run's are removed.
    assert [p.read_text() for p in (out / "tmp-run-001").rglob("left.txt")] == ["1"]
    assert not (out / "tmp-run-000").exists()


def _gpu_check() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_check", module)  # dataclasses look their module up
    spec.loader.exec_module(sys.modules["gpu_check"])
    return sys.modules["gpu_check"]


def test_gpu_check_runs_every_example_with_short_arguments(tmp_path: Path) -> None:
    gpu_check = _gpu_check()
    examples = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
    assert sorted(gpu_check.EXAMPLES) == examples, "add each new example to EXAMPLES"
    for dry_run in (True, False):
        names = [p.name for p in gpu_check.plan(dry_run, tmp_path, tmp_path)]
        assert len(names) == len(set(names))
        assert {f"example: {n}" for n in examples} <= set(names)


def test_gpu_check_skips_fp8_without_torchao(tmp_path: Path, monkeypatch: Any) -> None:
    gpu_check = _gpu_check()
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        gpu_check.importlib.util, "find_spec", lambda n: None if n == "torchao" else find_spec(n)
    )
    parts = {p.name: p for p in gpu_check.plan(False, tmp_path, tmp_path)}
    fp8 = [p for n, p in parts.items() if n.startswith("fp8: ")]
    assert [p.name for p in fp8] == ["fp8: dim 2048, 4 layers", "fp8: dim 4096, 2 layers"]
    assert all(p.skip == "torchao not installed" for p in fp8)
    assert not any(p.skip for n, p in parts.items() if not n.startswith("fp8: "))


@pytest.mark.slow
def test_gpu_check_dry_run_writes_every_part_into_summary_json(tmp_path: Path) -> None:
    # Two cheap parts run (a launched loop, a spelling); the others are in the summary as not
    # chosen. CI's .ci/run runs the whole dry run (every part) after the suite.
    out = tmp_path / "out"
    run = subprocess.run(
        ["make", "--no-print-directory", "gpu-check", "DRY_RUN=1", f"PYTHON={sys.executable}",
         f"OUT={out}", "GPU_CHECK_ARGS=--only README --only \"init_distributed(device='cpu')\""],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    expected = [p.name for p in _gpu_check().plan(True, tmp_path, out)]
    assert list(summary["parts"]) == expected
    chosen = summary["parts"].items()
    ran = {n: p for n, p in chosen if p["status"] != "skipped: not chosen (--only)"}
    assert sorted(ran) == ["README loop", "init_distributed(device='cpu')"], ran
    assert all(p["status"] == "pass" and p["seconds"] > 0 for p in ran.values()), ran
    assert re.fullmatch(r"-?\d+\.\d+(e-?\d+)?", ran["README loop"]["figures"]), ran
    assert ran["init_distributed(device='cpu')"]["figures"]["ctx.device"] == "cpu"
    assert len([p for p in out.rglob("*") if p.is_file()]) <= 8
    assert "README loop" in run.stdout and "parts passed or skipped" in run.stdout


@pytest.mark.slow
def test_gpu_suite_on_a_cpu_skips_every_test_with_its_reason() -> None:
    import torch

    if torch.cuda.is_available():  # there the suite runs: make gpu-check
        pytest.skip("CUDA is present: tests/gpu runs instead of skipping")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/gpu", "-p", "no:cacheprovider", "-rs", "-q"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:]
    skipped = re.search(r"(\d+) skipped in", run.stdout)
    assert skipped and int(skipped.group(1)) >= 14, run.stdout[-3000:]
    assert "passed" not in run.stdout and "failed" not in run.stdout, run.stdout[-3000:]
    reasons = re.findall(r"(?m)^SKIPPED \[\d+\] tests/gpu/\S+: (.*)$", run.stdout)
    # conftest's "needs CUDA", or a test's own skipif reason ("needs 2 GPUs"): never none
    assert "needs CUDA" in reasons and all(r.strip() for r in reasons), run.stdout[-3000:]


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
