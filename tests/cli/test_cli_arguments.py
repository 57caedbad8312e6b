"""Bad command-line input to `accel launch` / `accel config`: one line naming it, exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.test_cli import accel_cli

# Each case: the command line (with {dir}, {file}, {yaml} filled in), the YAML file's text, and
# what the one-line error must name.
CASES = {
    "port_flag": (["launch", "--main_process_port", "70000", "x.py"], "",
                  "main_process_port=70000"),
    "port_yaml": (["launch", "--config_file", "{yaml}", "x.py"], "main_process_port: 70000\n",
                  "main_process_port=70000"),
    "config_file_dir": (["launch", "--config_file", "{dir}", "x.py"], "", "is a folder"),
    "monitor_inf": (["launch", "--monitor_interval", "inf", "x.py"], "", "monitor_interval=inf"),
    "monitor_nan_yaml": (["launch", "--config_file", "{yaml}", "x.py"], "monitor_interval: .nan\n",
                         "monitor_interval=nan"),
    "log_dir_file": (["launch", "--log_dir", "{file}", "x.py"], "", "log_dir="),
    "config_default_dir": (["config", "--default", "--config_file", "{dir}"], "", "is a folder"),
    # Issue 29 item 8: argparse printed its 42-line usage for these.
    "num_processes_abc": (["launch", "--num_processes", "abc", "x.py"], "",
                          "--num_processes='abc' is not a whole number"),
    "tp_size_abc": (["launch", "--tp_size", "abc", "x.py"], "", "--tp_size='abc'"),
    "no_script": (["launch", "--num_processes", "2"], "", "no script given"),
    # Issue 25 item 6: a mistyped flag or command gets the close match.
    "flag_typo": (["launch", "--num_proceses", "2", "x.py"], "",
                  "--num_proceses is not a flag of `accel launch`; did you mean --num_processes?"),
    "command_typo": (["lanch", "x.py"], "", "unknown command 'lanch'; did you mean launch?"),
}  # fmt: skip

# Issue 29 item 8: the launcher refuses bad ACCEL_*_SIZE variables as it refuses the same flags,
# before any process starts (they used to fail inside every rank).
ENV_CASES = {
    "tp_size_abc": ({"ACCEL_TP_SIZE": "abc"}, ["--num_processes", "2"], "ACCEL_TP_SIZE='abc'"),
    "tp_size_3_of_2": ({"ACCEL_TP_SIZE": "3"}, ["--num_processes", "2"], "ACCEL_TP_SIZE"),
    "two_fills": ({"ACCEL_TP_SIZE": "-1", "ACCEL_CP_SIZE": "-1"}, [], "at most one size"),
    "flag_twin": ({}, ["--num_processes", "2", "--tp_size", "3"], "world_size=2"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_cli_input_is_one_line_naming_it(tmp_path: Path, case: str) -> None:
    argv, yaml_text, named = CASES[case]
    (tmp_path / "x.py").write_text("print('ran')\n")
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("not a folder")
    (tmp_path / "c.yaml").write_text(yaml_text)
    fill = {"{dir}": "adir", "{file}": "afile", "{yaml}": "c.yaml"}
    out = accel_cli(tmp_path, *[fill.get(a, a) for a in argv])
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr and "ran" not in out.stdout, out.stderr[-2000:]
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr[-2000:]
    assert named in out.stderr, out.stderr
    assert (tmp_path / "afile").read_text() == "not a folder"


@pytest.mark.parametrize("case", sorted(ENV_CASES))
def test_bad_mesh_variables_are_refused_by_the_launcher(tmp_path: Path, case: str) -> None:
    env, flags, named = ENV_CASES[case]
    (tmp_path / "x.py").write_text("print('ran')\n")
    out = accel_cli(tmp_path, "launch", *flags, "x.py", env=env)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "ran" not in out.stdout and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr[-2000:]
    assert named in out.stderr and out.stderr.startswith("accel launch: error: "), out.stderr
