"""Run a parsed `accel` command line: the subcommand's module is imported only when it runs.

The parser and the entry point are `accel_cli`'s (`accel_cli.main` parses, then calls `run`);
this package imports nothing from it, so the two packages form no circle: both read the
settings table from `accel_settings`, which imports neither.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import MappingProxyType

# Errors that mean "the user asked for something invalid", or a file or disk that cannot serve
# it (OSError: a full disk, a file where a folder must be): reported in one line.
_USER_ERRORS = (ValueError, OSError, NotImplementedError, EOFError)
_MODULES = MappingProxyType(
    {
        "config": "_config_cmd",
        "launch": "_launch",
        "env": "_env",
        "test": "_selftest",
        "estimate-memory": "_estimate",
        "merge-weights": "_merge",
    }
)


def run(args: argparse.Namespace) -> int:
    """Run the subcommand `args` was parsed for and return its exit code."""
    module = importlib.import_module(f"accel.cli.{_MODULES[args.command]}")
    try:
        return int(module.run(args))
    except BrokenPipeError:
        raise  # the reader of stdout went away: accel_cli.main ends quietly
    except _USER_ERRORS as err:
        text = str(err).removeprefix(f"accel {args.command}: ")  # named once
        print(f"accel {args.command}: error: {text}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
