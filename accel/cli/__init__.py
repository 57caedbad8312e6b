"""The `accel` command: config, launch, env, test, estimate-memory, merge-weights.

The parser lives in the top-level `accel_cli` module, so help and usage errors need no torch.
Every subcommand turns a bad argument, config key or path into one line on stderr and exit
code 2, with no traceback; failures of the launched script exit with code 1.
"""

from accel.cli._main import main, run

__all__ = ["main", "run"]
