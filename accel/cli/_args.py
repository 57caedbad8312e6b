"""Argument helpers shared by the subcommands."""

from __future__ import annotations

import argparse
from typing import Any


def add_flag(parser: argparse.ArgumentParser, name: str, **options: Any) -> None:
    """Add `--name_with_underscores` and its `--hyphenated-spelling` as one option."""
    spellings = [f"--{name}"]
    if "_" in name:
        spellings.append(f"--{name.replace('_', '-')}")
    parser.add_argument(*spellings, dest=name, **options)
