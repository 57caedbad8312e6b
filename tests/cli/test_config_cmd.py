"""`accel config` as a user answers it on real stdin, and the config `--show` and `env` report."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from accel.config import Config, as_mapping, load_config
from tests.cli.test_cli import accel_cli
from tests.test_config import ACCELERATE_SAMPLE


def _accelerate_default(tmp_path: Path, text: str) -> Path:
    """Accelerate's own default file, where `accelerate config` writes it ($HF_HOME)."""
    path = tmp_path / "hf" / "accelerate" / "default_config.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


def test_show_and_env_report_the_accelerate_file_that_launch_reads(tmp_path: Path) -> None:
    path = _accelerate_default(tmp_path, ACCELERATE_SAMPLE.replace("fp16", "bf16"))
    in_force = as_mapping(load_config(path))
    assert (in_force["num_processes"], in_force["mixed_precision"]) == (2, "bf16")
    shown = accel_cli(tmp_path, "config", "--show")
    assert shown.returncode == 0, shown.stderr
    header, body = shown.stdout.split("\n", 1)
    assert header == f"Config in force: {path}"
    assert yaml.safe_load(body) == in_force
    env = accel_cli(tmp_path, "env")
    assert env.returncode == 0, env.stderr
    assert f"- Config in force: {path}" in env.stdout
    assert all(
        f"  - {k}: {v}" in env.stdout for k, v in in_force.items() if not isinstance(v, dict)
    )
    # accel's own file, when there is one, comes first (as for `accel launch`).
    assert accel_cli(tmp_path, "config", "--default").returncode == 0
    ours = tmp_path / "xdg" / "accel" / "default_config.yaml"
    assert accel_cli(tmp_path, "config", "--show").stdout.startswith(f"Config in force: {ours}\n")


def test_show_without_any_file_names_both_places(tmp_path: Path) -> None:
    shown = accel_cli(tmp_path, "config", "--show")
    assert shown.returncode == 0, shown.stderr
    assert str(tmp_path / "xdg" / "accel" / "default_config.yaml") in shown.stdout
    assert str(tmp_path / "hf" / "accelerate" / "default_config.yaml") in shown.stdout
    assert "`accel launch` uses the defaults" in shown.stdout


def _answer(tmp_path: Path, answers: str, *flags: str) -> tuple[Config, str]:
    target = tmp_path / "c.yaml"
    out = accel_cli(tmp_path, "config", "--config_file", str(target), *flags, stdin=answers)
    assert out.returncode == 0, out.stdout + out.stderr
    return load_config(target), out.stdout


def test_a_bad_answer_is_asked_again_and_every_answer_is_kept(tmp_path: Path) -> None:
    # machines, processes (0: again), cpu (maybe: again), precision (BF16: again), accumulation
    config, stdout = _answer(tmp_path, "1\n0\n2\nmaybe\nyes\nBF16\nbf16\nx\n3\n")
    assert config == Config(
        distributed_type="MULTI_CPU", num_processes=2, use_cpu=True, mixed_precision="bf16",
        gradient_accumulation_steps=3,
    )  # fmt: skip
    problems = ("num_processes=0 must be an integer >= 1", "answer yes or no, not 'maybe'",
                "mixed_precision='BF16' is not a precision", "'x' is not an integer")  # fmt: skip
    for problem in problems:
        assert problem in stdout, stdout


def test_several_processes_are_written_as_accelerate_writes_them(tmp_path: Path) -> None:
    gpus, _ = _answer(tmp_path, "1\n4\nno\nfp16\n1\n")
    assert (gpus.distributed_type, gpus.num_processes, gpus.use_cpu) == ("MULTI_GPU", 4, False)
    one, _ = _answer(tmp_path, "1\n1\nno\nfp32\n1\n", "--force")
    assert one.distributed_type == "NO"
    # Two machines: the process count must split evenly over them, the rank be one of them.
    two, stdout = _answer(tmp_path, "2\n2\n1\n10.0.0.1\n29501\n3\n4\nyes\nno\n1\n", "--force")
    assert (two.num_machines, two.machine_rank, two.num_processes) == (2, 1, 4)
    assert (two.distributed_type, two.mixed_precision) == ("MULTI_CPU", "fp32")
    assert "machine_rank=2 must be below num_machines=2" in stdout
    assert "num_processes=3 is not divisible by num_machines=2" in stdout


def test_an_existing_config_is_kept_without_force(tmp_path: Path) -> None:
    target = tmp_path / "c.yaml"
    target.write_text("num_processes: 2\n")
    for argv, stdin in ((["--default"], None), ([], "1\n1\nno\nfp32\n1\n")):
        out = accel_cli(tmp_path, "config", "--config_file", str(target), *argv, stdin=stdin)
        assert out.returncode == 2 and target.read_text() == "num_processes: 2\n"
        assert out.stderr.strip() == (
            f"accel config: error: config_file={str(target)!r} already exists; pass --force to "
            "overwrite it, or --config_file to write another file."
        )
        assert "?" not in out.stdout  # refused before asking anything
    forced = accel_cli(tmp_path, "config", "--config_file", str(target), "--default", "--force")
    assert forced.returncode == 0 and load_config(target) == Config()


@pytest.mark.slow
def test_env_with_a_bad_config_prints_the_versions_before_the_error(tmp_path: Path) -> None:
    # A bug report's first command: the versions are what the reader needs even when the config
    # in force is what broke (issue 37 item 8).
    path = _accelerate_default(tmp_path, "mixed_precision: fp64\nnum_processes: 2\n")
    env = accel_cli(tmp_path, "env")
    assert env.returncode == 2, env.stdout
    assert "- torch: " in env.stdout and "- optional packages:" in env.stdout
    for package in ("transformers", "accelerate", "datasets", "deepspeed", "wandb", "torchao"):
        assert f"  - {package}: " in env.stdout, package
    error = env.stderr.splitlines()
    assert len(error) == 1 and error[0].startswith("accel env: error: "), env.stderr
    assert ("fp64" in error[0] and str(path) in error[0]) or "mixed_precision" in error[0]
