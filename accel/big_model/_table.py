"""A device map as a table per device: what is placed there, its bytes, its share of the budget."""

from __future__ import annotations

from collections.abc import Mapping

from accel.big_model._planner import Device


def _bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _names(names: list[str], width: int) -> str:
    """The names in map order, cut to about `width` characters with a count of the rest."""
    shown: list[str] = []
    for i, name in enumerate(names):
        if shown and len(", ".join([*shown, name or "(model)"])) > width:
            return ", ".join(shown) + f", ... ({len(names) - i} more)"
        shown.append(name or "(model)")
    return ", ".join(shown)


def _order(device: Device) -> tuple[int, int]:
    """Accelerators by index, then the CPU, then the disk: the order the planner fills them."""
    if isinstance(device, int):
        return (0, device)
    return (1 if device == "cpu" else 2, 0)


def render(
    device_map: Mapping[str, Device],
    sizes: Mapping[str, int],
    budgets: Mapping[Device, int],
    *,
    width: int = 60,
) -> str:
    """A Markdown table, one row per device of `device_map`; `sizes` holds the bytes under
    each module and tensor name, `budgets` the bytes each device may hold (none: no limit)."""
    placed: dict[Device, list[str]] = {}
    for name, device in device_map.items():
        placed.setdefault(device, []).append(name)
    rows = ["| device | modules | bytes | share of budget |", "|---|---|---|---|"]
    for device in sorted(placed, key=_order):
        names = placed[device]
        total = sum(sizes.get(name, 0) for name in names)
        budget = budgets.get(device)
        share = f"{total / budget:.1%} of {_bytes(budget)}" if budget else "no limit"
        rows.append(
            f"| {device} | {len(names)}: {_names(names, width)} | {_bytes(total)} | {share} |"
        )
    return "\n".join(rows)
