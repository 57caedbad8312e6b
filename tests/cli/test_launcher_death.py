"""Workers die with their launcher: a SIGKILLed `accel launch` leaves no training behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.cli.test_cli import _env
from tests.processes import alive

SCRIPT = """
import os, sys, time
from pathlib import Path
import accel

ctx = accel.init_distributed()
accel.wait_for_everyone(ctx)
Path(sys.argv[1], f"tmp-{ctx.rank}").write_text(str(os.getpid()))
os.replace(Path(sys.argv[1], f"tmp-{ctx.rank}"), Path(sys.argv[1], f"pid-{ctx.rank}"))
time.sleep(120)  # "training": far longer than the test waits
"""


def test_killing_the_launcher_kills_its_workers(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    argv = ["launch", "--num_processes", "2", str(script), str(tmp_path)]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "accel", *argv], env=_env(tmp_path), cwd=tmp_path,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while len(pids) < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, "workers never started"
            time.sleep(0.1)
            pids = [int(p.read_text()) for p in tmp_path.glob("pid-*")]
        launcher.send_signal(signal.SIGKILL)  # no chance to forward anything to the workers
        launcher.wait()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in pids if alive(p)] == []
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
