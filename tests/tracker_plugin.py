"""A user's own tracker, importable by path ("tests.tracker_plugin:ListTracker"), as a config
file or `accel launch --log_with` names one."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class ListTracker:
    """Writes each call as a line of text under `directory/project`."""

    def __init__(self, *, project: str, directory: Path | None) -> None:
        assert directory is not None
        self.path = directory / project / "calls.txt"

    def _write(self, line: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(line + "\n")

    def log(self, metrics: Any, *, step: int) -> None:
        self._write(f"log {step} {sorted(metrics.items())}")

    def log_hparams(self, hparams: Any) -> None:
        self._write(f"hparams {sorted(hparams.items())}")

    def close(self) -> None:
        self._write("close")
