"""README's training loop, copied out of README.md, run as its text says: `accel launch
--num_processes 2 train.py`. It prints one readable line, from the main process only (issue 37
item 7: both ranks printed their loss onto one line)."""

from __future__ import annotations

import math
from pathlib import Path

from tests.cli.test_cli import accel_cli
from tests.test_docs import ROOT, python_blocks


def _readme_loop() -> str:
    loops = [code for _, code in python_blocks(ROOT / "README.md") if "init_distributed" in code]
    assert len(loops) == 1, "README.md should hold one training loop"
    return loops[0]


def test_the_readme_loop_prints_one_line_at_two_processes(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(_readme_loop())
    run = accel_cli(tmp_path, "launch", "--num_processes", "2", "train.py")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert len(lines) == 1, f"expected one line from the main process, got {run.stdout!r}"
    loss = float(lines[0])  # one number, not two run together
    assert math.isfinite(loss) and loss >= 0.0
