"""Tracker names: the ones accel builds without a registry, and what can name a tracker.

Kept apart from the trackers themselves so the settings table (`log_with`) checks names without
importing them.
"""

from __future__ import annotations

from typing import Any

# Trackers accel builds by name without a registry (accel.tracking.BUILTIN_TRACKERS).
BUILTIN_TRACKER_NAMES = ("jsonl", "tensorboard", "wandb", "mlflow", "trackio")


def check_tracker_name(function: str, name: Any) -> str:
    """`name` if it can name a tracker (a registry key or "package.module:Factory")."""
    if not isinstance(name, str) or not name or name.strip() != name or "," in name:
        raise ValueError(
            f"{function}: tracker name {name!r} is not a name; expected e.g. 'wandb' or "
            "'package.module:MyTracker'."
        )
    if name == "all":
        raise ValueError(
            f"{function}: tracker name 'all' is not supported; accel builds the trackers you "
            f"name, e.g. {list(BUILTIN_TRACKER_NAMES)}. List them."
        )
    return name
