"""What `accel launch` prints: one line where one is due (issue 37 items 7 and 12).

Ctrl-C in a terminal sends SIGINT to the whole foreground process group: the launcher, torchrun's
agent inside it and every worker. A script that cannot start (no such module, a syntax error) is
refused before any worker starts, in one line naming the module, or the file and line. The
warning about transformers' Trainer and accumulation shows only for a script that uses one.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from accel.cli._script import misplaced_flags, uses_trainer
from tests.cli.test_cli import _env, accel_cli
from tests.processes import alive, descendants

# The last lines of a script that `started_launch` waits for: each rank says it is ready.
READY = """
sys.stdout.write(f"ready {ctx.rank}\\n")  # one write: both ranks share the launcher's pipe
sys.stdout.flush()
time.sleep(120)
"""
SLEEPER = (
    """
import sys
import time
import accel

ctx = accel.init_distributed()
"""
    + READY
)


@contextlib.contextmanager
def started_launch(tmp: Path, script: Path, *flags: str) -> Iterator[subprocess.Popen[str]]:
    """`accel launch --num_processes 2 *flags script`, in a session of its own (a terminal's
    foreground job), once both ranks said they are ready; its group is killed on the way out."""
    argv = [sys.executable, "-m", "accel", "launch", "--num_processes", "2", *flags, str(script)]
    launch = subprocess.Popen(
        argv, env=_env(tmp), cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert launch.stdout is not None
        ready = [launch.stdout.readline() for _ in range(2)]
        assert sorted(ready) == ["ready 0\n", "ready 1\n"], ready
        yield launch
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
        launch.communicate()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ctrl_c_during_a_two_process_launch_prints_one_line_and_exits_130(tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    with started_launch(tmp_path, script) as launch:
        workers = descendants(launch.pid)
        assert len(workers) >= 2, workers
        os.killpg(launch.pid, signal.SIGINT)  # what Ctrl-C does
        out, err = launch.communicate(timeout=120)
    assert launch.returncode == 130, err
    # torchrun's banner about OMP_NUM_THREADS comes at the start, before any worker runs
    after_start = [line for line in err.splitlines() if "torch/distributed/run.py" not in line]
    assert after_start == ["accel launch: stopped by SIGINT; the workers were stopped."], err
    assert out == ""
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in workers if alive(pid)], "workers outlived the launcher"


@pytest.mark.slow
def test_launch_of_a_missing_module_is_one_line_and_starts_no_worker(tmp_path: Path) -> None:
    out = accel_cli(tmp_path, "launch", "--num_processes", "2", "-m", "no_such_module")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert "no_such_module" in lines[0] and "accel launch: error:" in lines[0]
    assert "torch/distributed" not in out.stderr  # no worker, no agent ran


@pytest.mark.slow
def test_launch_of_a_script_with_a_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("import os\n\nx = (\n")
    out = accel_cli(tmp_path, "launch", "--num_processes", "2", str(script))
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert f"{script}, line 3" in lines[0], lines[0]
    assert "torch/distributed" not in out.stderr


@pytest.mark.slow
def test_launch_of_a_module_in_the_working_folder_still_runs(tmp_path: Path) -> None:
    # python -m looks in the working folder first; the check before the launch must too
    (tmp_path / "mine.py").write_text("import accel\nprint('ran', accel.init_distributed().rank)\n")
    out = accel_cli(tmp_path, "launch", "--num_processes", "1", "-m", "mine")
    assert out.returncode == 0, out.stderr
    assert "ran 0" in out.stdout


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from transformers import Trainer, TrainingArguments\n", True),
        ("from transformers.trainer_seq2seq import Seq2SeqTrainer\n", True),
        ("import transformers as tf\ntrainer = tf.Trainer(model=None)\n", True),
        ("from trl import SFTTrainer\n", True),
        ("from transformers import AutoModel\nimport accel\n", False),
        ("import torch\nclass Trainer: ...\n", False),  # the script's own class
    ],
)
def test_a_script_uses_a_trainer_only_when_it_imports_one(
    tmp_path: Path, source: str, expected: bool
) -> None:
    script = tmp_path / "train.py"
    script.write_text(source)
    assert uses_trainer(str(script), module=False) is expected


@pytest.mark.slow
def test_accumulation_without_a_trainer_launches_without_the_trainer_warning(
    tmp_path: Path,
) -> None:
    script = tmp_path / "plain.py"
    script.write_text("import accel\nprint(accel.init_distributed(grad_accum_steps=None).rank)\n")
    out = accel_cli(tmp_path, "launch", "--gradient_accumulation_steps", "2", str(script))
    assert out.returncode == 0, out.stderr
    assert "Trainer" not in out.stderr, out.stderr


# Issue 44 item 5: `accel launch train.py --num_processes 2` ran one process, silently.
REPORTS_WORLD = "import accel\nprint('world', accel.init_distributed().world_size)\n"


@pytest.mark.slow
def test_a_launch_flag_after_the_script_is_said_where_the_script_does_not_read_it(
    tmp_path: Path,
) -> None:
    script = tmp_path / "train.py"
    script.write_text(REPORTS_WORLD)
    out = accel_cli(tmp_path, "launch", str(script), "--num_processes", "2")
    assert out.returncode == 0, out.stderr
    assert "world 1" in out.stdout  # the flag is the script's: it asked for it there
    said = [line for line in out.stderr.splitlines() if "--num_processes" in line]
    assert len(said) == 1, out.stderr
    assert "accel launch: warning:" in said[0] and "before the script" in said[0], said[0]


@pytest.mark.parametrize(
    ("source", "misplaced"),
    [
        (REPORTS_WORLD, ["--num_processes"]),  # reads no argument at all
        (
            "import argparse\np = argparse.ArgumentParser()\np.add_argument('--num_processes')\n",
            [],
        ),  # its own flag of that name
        ("import argparse\np = argparse.ArgumentParser()\np.add_argument('--num-processes')\n", []),
        ("def main(num_processes: int = 1): ...\nimport fire\nfire.Fire(main)\n", []),
        ("from transformers import HfArgumentParser\n", []),  # fields accel cannot see
    ],
)
def test_misplaced_launch_flags_are_those_the_script_never_names(
    tmp_path: Path, source: str, misplaced: list[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text(source)
    launcher = frozenset({"--num_processes", "--num-processes", "--mixed_precision"})
    found = misplaced_flags(
        str(script), module=False, script_args=["--num_processes", "2", "--lr", "1"],
        launcher_flags=launcher,
    )  # fmt: skip
    assert found == misplaced


def _package(tmp_path: Path) -> None:
    """A package in the working folder whose `__init__` says when it is imported."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("print('pkg imported')\n")
    (tmp_path / "pkg" / "plain.py").write_text(
        "import accel\nprint('ran', accel.init_distributed(grad_accum_steps=None).rank)\n"
    )


@pytest.mark.slow
def test_launch_of_a_missing_submodule_is_one_line_and_starts_no_worker(tmp_path: Path) -> None:
    """Issue 44 item 6: only the package of a dotted `-m` name was looked up."""
    _package(tmp_path)
    out = accel_cli(tmp_path, "launch", "--num_processes", "2", "-m", "pkg.missing")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert "no module 'pkg.missing' in package 'pkg'" in lines[0], lines[0]
    assert "pkg imported" not in out.stdout  # found without importing the package
    assert "torch/distributed" not in out.stderr  # no worker, no agent ran


@pytest.mark.slow
def test_a_submodule_without_a_trainer_launches_without_the_trainer_warning(
    tmp_path: Path,
) -> None:
    """Issue 44 item 7: any dotted `-m` module counted as a Trainer script."""
    _package(tmp_path)
    out = accel_cli(tmp_path, "launch", "--gradient_accumulation_steps", "2", "-m", "pkg.plain")
    assert out.returncode == 0, out.stderr
    assert "ran 0" in out.stdout and out.stdout.count("pkg imported") == 1  # the worker's only
    assert "Trainer" not in out.stderr, out.stderr


OMP_SCRIPT = (
    "import os, sys, accel\n"
    "rank = accel.init_distributed().rank\n"
    "sys.stdout.write(f\"omp {rank} {os.environ['OMP_NUM_THREADS']}\\n\")  # one write a rank\n"
)


@pytest.mark.slow
@pytest.mark.parametrize("given", [None, "3"])
def test_a_two_process_launch_sets_omp_threads_without_torchruns_banner(
    tmp_path: Path, given: str | None
) -> None:
    """Issue 44 item 7: torchrun's 4-line OMP_NUM_THREADS banner headed every launch."""
    script = tmp_path / "omp.py"
    script.write_text(OMP_SCRIPT)
    env = {} if given is None else {"OMP_NUM_THREADS": given}
    out = accel_cli(tmp_path, "launch", "--num_processes", "2", str(script), env=env)
    assert out.returncode == 0, out.stderr
    assert "OMP_NUM_THREADS" not in out.stderr and "*****" not in out.stderr, out.stderr
    threads = given or "1"  # torchrun's default for several processes a machine, or the user's
    assert sorted(out.stdout.split("\n")[:2]) == [f"omp 0 {threads}", f"omp 1 {threads}"]


@pytest.mark.slow
def test_accel_test_says_nothing_about_transformers_trainer(tmp_path: Path) -> None:
    """Issue 44 item 7: the Trainer-only accumulation warning fired on `accel test`."""
    config = tmp_path / "accum.yaml"
    config.write_text("gradient_accumulation_steps: 2\n")
    out = accel_cli(tmp_path, "test", "--config_file", str(config), "--num_processes", "2")
    assert out.returncode == 0, out.stderr
    assert "accel test: passed" in out.stdout
    assert "Trainer" not in out.stderr, out.stderr


def test_a_folder_named_like_an_installed_package_does_not_hide_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkout (or any folder without __init__.py) named `accel` in the working folder is a
    namespace portion, which `python -m` passes over for the installed package: `accel test`
    run beside a checkout found `accel.cli._selftest_worker` missing."""
    from accel.cli._script import check_script

    (tmp_path / "accel").mkdir()
    monkeypatch.chdir(tmp_path)
    check_script("accel.cli._selftest_worker", module=True)  # found: no error
    missing = "no module 'accel.cli.missing' in package 'accel.cli'"
    with pytest.raises(ValueError, match=re.escape(missing)):
        check_script("accel.cli.missing", module=True)
