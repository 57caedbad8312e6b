"""`accel test`: launch a short distributed self-check over the configured world."""

from __future__ import annotations

import argparse

from accel.cli import _launch
from accel_settings import KEYS


def run(args: argparse.Namespace) -> int:
    launch_args = argparse.Namespace(
        **{name: None for name in KEYS},
        config_file=args.config_file,
        log_dir=None,
        tee=None,
        module=True,
        script="accel.cli._selftest_worker",
        script_args=[],
    )
    launch_args.num_processes = args.num_processes
    code = _launch.run(launch_args)
    print("accel test: passed" if code == 0 else "accel test: FAILED (see the output above)")
    return code
