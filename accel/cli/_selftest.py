"""`accel test`: launch a short distributed self-check over the configured world."""

from __future__ import annotations

import argparse
from typing import Any

from accel.cli import _launch
from accel.cli._args import add_flag


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "test",
        help="check collectives, a DDP step and a checkpoint round trip on the configured world",
        description="Launch a short self-check on every process of the configured world (the "
        "config in force, or --config_file, and --num_processes): a gather and a reduce, one "
        "DDP step against the full-batch step, a safetensors round trip. Exits 1 on failure.",
    )
    add_flag(parser, "config_file", default=None, help="YAML config (default: the one in force)")
    add_flag(parser, "num_processes", type=int, default=None, help="override the process count")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    launch_args = argparse.Namespace(
        **{name: None for name, *_ in _launch._OVERRIDES},
        config_file=args.config_file,
        use_cpu=None,
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
