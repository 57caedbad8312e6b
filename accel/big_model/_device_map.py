"""Pure planning for big models: tensor sizes per module and the greedy device map.

Nothing here touches a device: sizes come from shapes and dtypes (meta tensors work), and the
plan works with any `max_memory` dict, whether or not those devices exist on this machine.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from accel._size import parse_size

Device = int | str
"""A device-map value: an accelerator index, "cpu" or "disk"."""

OFFLOAD = ("cpu", "disk")


@dataclass(frozen=True, slots=True)
class Unit:
    """One placeable piece: a module, or one tensor held directly by a split module."""

    name: str
    """Module name ("" for the root) or full tensor name ("block.weight")."""
    size: int
    """Bytes it needs, counting each tied tensor only at its first name."""
    children: tuple[Unit, ...]
    """What it splits into (empty: it cannot be split)."""
    tied: frozenset[int]
    """Ids of the tied tensors it holds (any of their names)."""


def tensor_nbytes(t: torch.Tensor, dtype: torch.dtype | None) -> int:
    """Bytes of `t`, as `dtype` when given and `t` is floating point."""
    itemsize = dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size()
    return t.numel() * itemsize


def named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer under every name (tied ones repeat), in module order."""
    out: list[tuple[str, torch.Tensor]] = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        out += [(dot + n, p) for n, p in module._parameters.items() if p is not None]
        out += [(dot + n, b) for n, b in module._buffers.items() if b is not None]
    return out


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Names that share one tensor, for every tensor reachable under more than one name."""
    by_id: dict[int, list[str]] = {}
    for name, t in named_tensors(model):
        by_id.setdefault(id(t), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def module_sizes(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, int]:
    """Bytes under each module name ("" is the whole model); a tied tensor counts once."""
    sizes: dict[str, int] = {}
    seen: set[int] = set()
    for name, t in named_tensors(model):
        if id(t) in seen:
            continue
        seen.add(id(t))
        nbytes = tensor_nbytes(t, dtype)
        parts = name.split(".")[:-1]
        sizes[""] = sizes.get("", 0) + nbytes
        for i in range(1, len(parts) + 1):
            key = ".".join(parts[:i])
            sizes[key] = sizes.get(key, 0) + nbytes
    for name, _ in model.named_modules():
        sizes.setdefault(name, 0)
    return sizes


def build_units(model: nn.Module, no_split: Iterable[str], dtype: torch.dtype | None) -> Unit:
    """The module tree as units: no_split classes and leaves have no children."""
    no_split = frozenset(no_split)
    names = named_tensors(model)
    counts: dict[int, int] = {}
    for _, t in names:
        counts[id(t)] = counts.get(id(t), 0) + 1
    tied_ids = frozenset(i for i, c in counts.items() if c > 1)
    seen: set[int] = set()
    own_size: dict[str, int] = {}
    for name, t in names:
        own_size[name] = 0 if id(t) in seen else tensor_nbytes(t, dtype)
        seen.add(id(t))

    def unit(prefix: str, module: nn.Module) -> Unit:
        dot = f"{prefix}." if prefix else ""
        leaves = [
            Unit(dot + n, own_size[dot + n], (), frozenset({id(t)} & tied_ids))
            for n, t in [*module._parameters.items(), *module._buffers.items()]
            if t is not None
        ]
        kids = [unit(dot + n, m) for n, m in module._modules.items() if m is not None]
        parts = leaves + kids
        tied = frozenset().union(*(p.tied for p in parts)) if parts else frozenset()
        split = bool(kids) and type(module).__name__ not in no_split
        return Unit(prefix, sum(p.size for p in parts), tuple(parts) if split else (), tied)

    return unit("", model)


def plan(root: Unit, max_memory: Mapping[Device, int]) -> dict[str, Device]:
    """Greedy placement in module order; reserves room for the largest offloaded unit on the
    execution device, re-planning until that reservation covers every offloaded unit."""
    devices = ordered_devices(max_memory)
    reserve = 0
    while True:
        placed, largest = _greedy(root, devices, max_memory, reserve)
        if largest <= reserve:
            return placed
        reserve = largest


def ordered_devices(max_memory: Mapping[Device, int]) -> list[Device]:
    """Accelerators by index, then "cpu", then "disk" (those present in `max_memory`)."""
    accelerators = sorted(d for d in max_memory if isinstance(d, int))
    return [*accelerators, *(d for d in OFFLOAD if d in max_memory)]


def offloaded(device: Device, devices: list[Device]) -> bool:
    """Whether a unit on `device` runs on another device (the first one) through hooks."""
    return device != devices[0] and isinstance(device, str)


def _greedy(
    root: Unit, devices: list[Device], max_memory: Mapping[Device, int], reserve: int
) -> tuple[dict[str, Device], int]:
    placed: dict[str, Device] = {}
    tied_home: dict[int, Device] = {}
    left = {d: max_memory[d] - (reserve if i == 0 else 0) for i, d in enumerate(devices)}
    queue = deque([root])
    index = 0
    largest = 0
    while queue:
        unit = queue.popleft()
        home = [tied_home[t] for t in unit.tied if t in tied_home]
        if home and (unit.size == 0 or not unit.children):
            device = home[0]
            if unit.size > left[device]:
                raise ValueError(
                    f"infer_device_map: {unit.name!r} shares a tied tensor with a module on "
                    f"{device!r} but does not fit there ({unit.size} bytes, {left[device]} left). "
                    "Raise that device's max_memory or untie the weights."
                )
        elif home or unit.size > left[devices[index]]:
            if unit.children:
                queue.extendleft(reversed(unit.children))
                continue
            while unit.size > left[devices[index]]:
                index += 1
                if index == len(devices):
                    raise _too_small(unit, max_memory, reserve)
            device = devices[index]
        else:
            device = devices[index]
        left[device] -= unit.size
        placed[unit.name] = device
        tied_home.update(dict.fromkeys(unit.tied, device))
        if offloaded(device, devices):
            largest = max(largest, unit.size)
    return placed, largest


def _too_small(unit: Unit, max_memory: Mapping[Device, int], reserve: int) -> ValueError:
    extra = f" (keeping {reserve} bytes on the first device for offloaded layers)" * bool(reserve)
    name = unit.name or "the model"
    return ValueError(
        f"infer_device_map: max_memory={dict(max_memory)} is too small: {name!r}"
        f" needs {unit.size} bytes and no device has that much left{extra}. Raise the budgets, "
        'add "disk" to max_memory (with an offload_dir), or load with a smaller dtype.'
    )


def budgets(fn: str, max_memory: Mapping[Device, int | str] | None) -> dict[Device, int]:
    """Validate budgets (ints or strings like "10GiB"); default: what this machine has free."""
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
    return budgets


def _available_memory() -> dict[Device, int]:
    budgets: dict[Device, int] = {}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            budgets[i] = int(torch.cuda.mem_get_info(i)[0] * 0.9)
    try:  # MemAvailable counts reclaimable page cache; the sysconf fallback counts free pages
        with open("/proc/meminfo") as f:
            lines = dict(line.split(":", 1) for line in f)
        available = int(lines["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    budgets["cpu"] = int(available * 0.9)
    return budgets
