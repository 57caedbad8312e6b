"""A new launcher setting costs its row and its consumer: nothing else lists settings.

The test copies the library, adds one row to a section of the table (`accel_settings`) and the
field it fills to the value that holds it (`WrapDefaults`), and launches a real `accel launch`
with the new flag: the worker's RunContext holds the value, read from its own variable. No
other file is touched: the flag, the variable, the worker's reading and `describe()` follow.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.cli.test_cli import REPO, accel_cli

pytestmark = pytest.mark.slow  # one real launch

ROW = """        Setting(key="probe_level", kind="count", field="probe_level",
                env="ACCEL_PROBE_LEVEL", help="a test-only setting"),
"""
FIELD = '''    probe_level: int = 1
    """A test-only setting."""

'''
SCRIPT = """
import json, sys
import accel
ctx = accel.init_distributed()
json.dump({"value": ctx.wrap.probe_level, "source": ctx.sources["probe_level"],
           "module": accel.__file__}, open(sys.argv[1], "w"))
accel.shutdown(ctx)
"""


def _edit(path: Path, anchor: str, added: str, *, before: bool = False) -> None:
    text = path.read_text()
    assert text.count(anchor) == 1, (path, anchor)
    path.write_text(text.replace(anchor, added + anchor if before else anchor + added))


def test_a_row_and_its_field_reach_a_launched_worker(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    for package in ("accel", "accel_settings"):
        shutil.copytree(REPO / package, lib / package, ignore=shutil.ignore_patterns("__pycache__"))
    # 1. The row, in a section of the table (the mesh section's module here).
    _edit(
        lib / "accel_settings" / "mesh.py",
        '        _size("tp", "tensor-parallel size", "tp_size"),\n',
        ROW,
    )
    # 2. Its consumer: the field it fills, in the value that holds it.
    anchor = "    def __post_init__(self) -> None:\n        if self.fsdp"
    _edit(lib / "accel" / "_options.py", anchor, FIELD, before=True)
    (tmp_path / "script.py").write_text(SCRIPT)
    out = accel_cli(
        tmp_path, "launch", "--num_processes", "1", "--use_cpu", "--probe_level", "3",
        "script.py", str(tmp_path / "seen.json"),
        env={"PYTHONPATH": f"{lib}:{REPO}"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["module"].startswith(str(lib))  # the edited copy ran, in the worker too
    assert (seen["value"], seen["source"]) == (3, "env ACCEL_PROBE_LEVEL")
