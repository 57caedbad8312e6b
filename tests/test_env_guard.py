"""The suite's environment guard (tests/conftest.py, rules in tests/env_guard.py): a variable a
test leaves changed is refused; one torch writes once per process where it was absent is not."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from tests.env_guard import SET_BY_DEEPSPEED, SET_BY_TORCH, leaked

INDUCTOR = Path(torch.__file__).parent / "_inductor"
WRITES = re.compile(r"""os\.environ\[\s*["']([A-Z_]+)["']\s*\]\s*=""")


def test_variables_torch_writes_where_absent_are_not_leaks() -> None:
    # what inductor wrote during the compiled FSDP2 case on an H200, which the guard refused
    after = {"HOME": "/h", "TRITON_CACHE_DIR": "/tmp/t", "TRITON_PTXAS_PATH": "/x/ptxas"}
    assert leaked({"HOME": "/h"}, after) == set()
    assert leaked({"HOME": "/h"}, {**after, "PYTEST_CURRENT_TEST": "t"}) == set()


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        ({}, {"ACCEL_X": "1"}, {"ACCEL_X"}),  # set by a test or by accel
        ({"ACCEL_X": "1"}, {}, {"ACCEL_X"}),  # removed
        ({"TRITON_CACHE_DIR": "/mine"}, {"TRITON_CACHE_DIR": "/other"}, {"TRITON_CACHE_DIR"}),
        ({"TRITON_CACHE_DIR": "/mine"}, {}, {"TRITON_CACHE_DIR"}),
        ({}, {"TRITON_OTHER": "1"}, {"TRITON_OTHER"}),  # only the names torch writes
    ],
)
def test_a_variable_a_test_changes_is_a_leak(
    before: dict[str, str], after: dict[str, str], expected: set[str]
) -> None:
    assert leaked(before, after) == expected


def test_the_names_are_those_torch_writes() -> None:
    """Each name in SET_BY_TORCH is one torch's inductor writes, and every Triton variable it
    writes is in SET_BY_TORCH: a torch that writes another is caught here, not on a GPU."""
    written = {m for p in INDUCTOR.rglob("*.py") for m in WRITES.findall(p.read_text())}
    assert written >= SET_BY_TORCH
    assert {n for n in written if n.startswith("TRITON_")} <= SET_BY_TORCH


def test_the_variable_deepspeed_sets_on_import_is_one_it_writes() -> None:
    spec = importlib.util.find_spec("deepspeed")  # read, not imported (seconds)
    if spec is None or spec.origin is None:
        pytest.skip("deepspeed is not installed (the `deepspeed` extra)")
    source = Path(spec.origin).read_text()
    sets = set(re.findall(r"""os\.environ\.setdefault\(\s*["']([A-Z_]+)["']""", source))
    assert sets >= SET_BY_DEEPSPEED
    assert leaked({}, {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}) == set()
