"""The `accel` command: config, launch, env, test, estimate-memory, merge-weights.

The parser and the entry point live in the top-level `accel_cli` package, so help and usage
errors need no torch; `accel_cli.main` calls `run` here for a command line that parsed.
Every subcommand turns a bad argument, config key or path into one line on stderr and exit
code 2, with no traceback; failures of the launched script exit with code 1.
"""

from accel.cli._main import run

__all__ = ["run"]
