"""`accel launch --shutdown_timeout S`: how long torchrun's agent waits for its workers after it
passes a stop signal on (SLURM's `--signal=USR1@90` leaves 90 s; torchrun's own default is 30),
then SIGKILL. Issue 36: a checkpoint that takes longer than the grace period is cut short."""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import pytest

from accel.cli import _launch
from accel.config import Config, parse_config
from tests.cli.test_launch_output import READY, started_launch
from tests.processes import alive, descendants

SLOW_SAVE = (
    """
import signal, sys, time
import accel

ctx = accel.init_distributed()


def save_and_exit(*_):  # a save that takes longer than the grace period
    time.sleep(30)
    sys.exit(0)


signal.signal(signal.SIGTERM, save_and_exit)
"""
    + READY
)


def test_the_grace_period_reaches_torchrun_and_is_checked() -> None:
    args = argparse.Namespace(log_dir=None, tee=None, module=True, script="m", script_args=[])
    argv = _launch.torchrun_argv(parse_config({"shutdown_timeout": 85}), args)
    assert argv[argv.index("--shutdown-timeout") + 1] == "85"
    assert "--shutdown-timeout" not in _launch.torchrun_argv(Config(), args)
    with pytest.raises(ValueError, match=r"shutdown_timeout=-1 must be an integer >= 0"):
        parse_config({"shutdown_timeout": -1})


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_workers_still_saving_when_the_grace_period_ends_are_killed(tmp_path: Path) -> None:
    script = tmp_path / "slow_save.py"
    script.write_text(SLOW_SAVE)
    with started_launch(tmp_path, script, "--shutdown_timeout", "2") as launch:
        workers = descendants(launch.pid)
        start = time.monotonic()
        os.kill(launch.pid, signal.SIGTERM)  # the scheduler's stop, to the launcher only
        _, err = launch.communicate(timeout=120)
        waited = time.monotonic() - start
    assert launch.returncode == 128 + signal.SIGTERM, err
    # the agent passed SIGTERM on, waited 2 s, then killed the saves (30 s each) with SIGKILL
    assert "SIGTERM received; the workers did not all stop cleanly" in err, err
    assert "0: -9" in err and "1: -9" in err, err
    assert waited < 20, waited  # torchrun's default grace period (30 s) would have let them save
    assert not [pid for pid in workers if alive(pid)]
