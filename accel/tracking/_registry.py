"""Trackers by name: the built-in factories, a registry as a value, and names as import paths.

There is no process-wide registry to add to (STYLE.md forbids module state): a registry is an
immutable mapping of names to factories that the caller holds and passes, `register_tracker`
returns a new one, and a name written as "package.module:Factory" is imported where it is used,
so a config file or `accel launch --log_with` can name a user's own tracker too.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

from accel.tracking._files import JSONLTracker, TensorBoardTracker
from accel.tracking._services import MLflowTracker, TrackioTracker, WandbTracker
from accel_settings.tracker_names import BUILTIN_TRACKER_NAMES


class TrackerFactory(Protocol):
    """What `init_trackers` calls to build a tracker: `factory(project=..., directory=...)`
    (`directory` is a `Path` or None); a tracker class with that signature is one."""

    def __call__(self, *, project: str, directory: Path | None) -> Any: ...


def _need_directory(name: str, directory: Path | None) -> Path:
    if directory is None:
        raise ValueError(
            f"init_trackers: directory=None but {name!r} writes files into a folder; pass "
            "directory='runs/NAME'."
        )
    return directory


def _jsonl(*, project: str, directory: Path | None) -> JSONLTracker:
    return JSONLTracker(_need_directory("jsonl", directory) / project / "metrics.jsonl")


def _tensorboard(*, project: str, directory: Path | None) -> TensorBoardTracker:
    return TensorBoardTracker(_need_directory("tensorboard", directory) / project / "tensorboard")


def _wandb(*, project: str, directory: Path | None) -> WandbTracker:
    return WandbTracker(project, directory=directory)


def _mlflow(*, project: str, directory: Path | None) -> MLflowTracker:
    # A SQLite store in the folder: MLflow 3 refuses its old file store unless told to allow it.
    uri = None if directory is None else f"sqlite:///{directory.absolute() / 'mlflow.db'}"
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
    return MLflowTracker(project, tracking_uri=uri)


def _trackio(*, project: str, directory: Path | None) -> TrackioTracker:
    if directory is not None:
        raise ValueError(
            f"init_trackers: directory={str(directory)!r} cannot reach 'trackio', which keeps "
            "every project in $TRACKIO_DIR; set TRACKIO_DIR before the run and build trackio "
            "with directory=None (a separate init_trackers call)."
        )
    return TrackioTracker(project)


BUILTIN_TRACKERS: Mapping[str, TrackerFactory] = MappingProxyType(
    {
        "jsonl": _jsonl,
        "tensorboard": _tensorboard,
        "wandb": _wandb,
        "mlflow": _mlflow,
        "trackio": _trackio,
    }
)
assert tuple(BUILTIN_TRACKERS) == BUILTIN_TRACKER_NAMES


def resolve(name: str, registry: Mapping[str, Any]) -> Callable[..., Any]:
    """The factory `name` stands for in `registry`, or imported from "module:attribute"."""
    if name in registry:
        return registry[name]  # type: ignore[no-any-return]
    if ":" not in name:
        raise ValueError(
            f"init_trackers: tracker name {name!r} is not known; expected one of "
            f"{sorted(registry)} or 'package.module:Factory'. Add it with "
            f"registry = accel.register_tracker({name!r}, factory) and pass registry=registry."
        )
    module_name, _, attribute = name.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute)  # type: ignore[no-any-return]
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"init_trackers: tracker name {name!r} does not import ({err}); write it as "
            "'package.module:Factory' with an importable module."
        ) from err


def as_directory(directory: str | os.PathLike[str] | None) -> Path | None:
    """`directory` as a Path (None stays None)."""
    return None if directory is None else Path(directory)
