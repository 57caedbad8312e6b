"""The `accel` entry point: one parser, a subcommand per module."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from accel.cli import _config_cmd, _env, _estimate, _launch, _merge, _selftest

# Errors that mean "the user asked for something invalid", or a file or disk that cannot serve
# it (OSError: a full disk, a file where a folder must be): reported in one line.
_USER_ERRORS = (ValueError, OSError, NotImplementedError, EOFError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="accel",
        description="Launch and inspect accel training runs (built on torch.distributed.run).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (_config_cmd, _launch, _env, _selftest, _estimate, _merge):
        module.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `accel` command line and return its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except _USER_ERRORS as err:
        print(f"accel {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
