"""`accel launch --num_machines 2` with c10d rendezvous when the other machine never arrives:
one line naming the endpoint and the timeout, a non-zero exit, and no process left behind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.cli.test_cli import _env
from tests.processes import leftovers


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_machine_that_never_arrives_is_one_line(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not start without machine 1')\n")
    port = _free_port()
    argv = [
        sys.executable, "-m", "accel", "launch", "--num_machines", "2", "--num_processes", "2",
        "--machine_rank", "0", "--rdzv_backend", "c10d", "--main_process_ip", "127.0.0.1",
        "--main_process_port", str(port), "--rdzv_conf", "join_timeout=5", str(script),
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, env=_env(tmp_path), cwd=tmp_path, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    endpoint = f"127.0.0.1:{port}"
    assert lines[-1].startswith("accel launch: "), stderr
    assert endpoint in lines[-1] and "5 s" in lines[-1] and "join_timeout" in lines[-1], stderr
    assert "Traceback" not in stderr, stderr
    assert stdout == ""
    assert leftovers(os.getpid()) == []


def test_rdzv_conf_reaches_torchrun_and_is_checked(tmp_path: Path) -> None:
    import argparse

    import pytest

    from accel.cli import _launch
    from accel.config import Config, load_config, parse_config

    args = argparse.Namespace(log_dir=None, tee=None, module=True, script="m", script_args=[])
    config = tmp_path / "c.yaml"  # Accelerate's YAML key
    config.write_text(
        "num_machines: 2\nnum_processes: 4\nrdzv_backend: c10d\nmain_process_ip: h\n"
        "main_process_port: 9\nrdzv_conf: join_timeout=60, last_call_timeout=5\n"
    )
    argv = _launch.torchrun_argv(load_config(config), args)
    assert argv[argv.index("--rdzv-conf") + 1] == "join_timeout=60,last_call_timeout=5"
    one = _launch.torchrun_argv(Config(max_restarts=1, rdzv_conf="is_host=true"), args)
    assert one[one.index("--rdzv-conf") + 1] == "is_host=true"
    with pytest.raises(ValueError, match=r"rdzv_conf='join_timeout=5' configures the c10d"):
        _launch.torchrun_argv(Config(num_processes=2, rdzv_conf="join_timeout=5"), args)
    with pytest.raises(ValueError, match=r"rdzv_conf has unknown key 'join_timout'.*join_timeout"):
        parse_config({"rdzv_conf": "join_timout=5"})
    with pytest.raises(ValueError, match=r"rdzv_conf: join_timeout='soon' must be a whole"):
        parse_config({"rdzv_conf": "join_timeout=soon"})
    with pytest.raises(ValueError, match=r"rdzv_conf='60' must be 'key=value' pairs"):
        parse_config({"rdzv_conf": "60"})
