"""The inputs of planning: budgets (bytes, or size strings parsed as Accelerate parses them)
and the bytes under each module. The plan itself is in `_planner`."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import nn

from accel._size import parse_size
from accel.big_model import _planner
from accel.big_model._planner import Device

OFFLOAD = ("cpu", "disk")


def module_sizes(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, int]:
    """Bytes under each module name ("" is the whole model); a tied tensor counts once."""
    sizes = _planner.sizes(model, dtype)
    return {name: sizes.get(name, 0) for name, _ in model.named_modules()}


def budgets(fn: str, max_memory: Mapping[Device, int | str] | None) -> dict[Device, int]:
    """Validate budgets (ints or size strings); default: what this machine has free.

    As in Accelerate, budgets that do not name "cpu" get 80% of the available RAM for it.
    """
    if max_memory is None:
        return _available_memory()
    if not isinstance(max_memory, Mapping) or not max_memory:
        raise ValueError(
            f"{fn}: max_memory={max_memory!r} must be a non-empty dict of device -> bytes, "
            'e.g. {0: "10GiB", "cpu": "30GiB", "disk": "1TB"}.'
        )
    budgets: dict[Device, int] = {}
    for device, budget in max_memory.items():
        if not (isinstance(device, int) and device >= 0) and device not in OFFLOAD:
            raise ValueError(
                f"{fn}: max_memory key {device!r} is not a device; use accelerator indices "
                '(0, 1, ...), "cpu" or "disk".'
            )
        budgets[device] = parse_size(fn, f"max_memory[{device!r}]", budget)
    if "cpu" not in budgets:
        budgets["cpu"] = int(_cpu_available() * 0.8)
    return budgets


def _available_memory() -> dict[Device, int]:
    budgets: dict[Device, int] = {}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            budgets[i] = int(torch.cuda.mem_get_info(i)[0] * 0.9)
    budgets["cpu"] = int(_cpu_available() * 0.9)
    return budgets


def _cpu_available() -> int:
    try:  # MemAvailable counts reclaimable page cache; the sysconf fallback counts free pages
        with open("/proc/meminfo") as f:
            lines = dict(line.split(":", 1) for line in f)
        return int(lines["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
