"""Metrics, hyper-parameters and progress bars, written by the main process only.

Trackers are plain objects the user creates (or `init_trackers` builds by name), passes to
`log_metrics` / `log_hparams`, and closes (or uses as context managers). Every rank may create
them: nothing touches the disk until the main process logs, so the same line of code runs
unchanged on every rank. Optional packages (`tensorboard`, `wandb`, `mlflow`, `trackio`, `tqdm`)
are imported only when a tracker or bar that needs them is created.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

import torch

from accel.context import RunContext
from accel.tracking._files import JSONLTracker, TensorBoardTracker
from accel.tracking._progress import progress
from accel.tracking._registry import (
    BUILTIN_TRACKERS,
    TrackerFactory,
    as_directory,
    resolve,
)
from accel.tracking._services import MLflowTracker, TrackioTracker, WandbTracker
from accel_settings.tracker_names import check_tracker_name

__all__ = [
    "BUILTIN_TRACKERS",
    "JSONLTracker",
    "MLflowTracker",
    "TensorBoardTracker",
    "Tracker",
    "TrackerFactory",
    "TrackioTracker",
    "WandbTracker",
    "init_trackers",
    "log_hparams",
    "log_metrics",
    "progress",
    "register_tracker",
]

# The key of a JSONL line that carries the hyper-parameters, so no metric may use it. A metric
# named "step" is allowed (Accelerate's scripts log one): JSONLTracker keeps it apart when it
# is not the step.
_RESERVED = frozenset({"hparams"})


@runtime_checkable
class Tracker(Protocol):
    """What `log_metrics` and `log_hparams` need from a tracker; write your own to plug in
    another service (wandb, MLflow, ...).

    A tracker may also have `check_log(metrics, *, step)`, raising what `log` would refuse and
    writing nothing: `log_metrics` calls it on every tracker before any `log`, so a record
    goes to all of them or to none (the built-in trackers have it).
    """

    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        """Record `metrics` at `step`: name to a number, a string, or a dict of names to
        numbers (Accelerate's tracker values)."""

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        """Record the run's hyper-parameters (called at most once per tracker)."""

    def close(self) -> None:
        """Flush and release files; further logging is an error."""


def _number(key: str, value: Any) -> float | int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"log_metrics: metrics[{key}] is a tensor of shape {tuple(value.shape)}; "
                f"expected one number. Reduce it first, e.g. loss.mean()."
            )
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"log_metrics: metrics[{key}]={value!r} is a {type(value).__name__}; expected a "
            "number, a one-element tensor, a string, or a dict of names to numbers."
        )
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _value(key: str, value: Any) -> float | int | str | dict[str, float | int]:
    """A metric as trackers get it: numbers and strings as they are, tensors as numbers, a dict
    (an `evaluate` metric's result, as GLUE's script logs it) as a dict of numbers."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        for name in value:
            if not isinstance(name, str):
                raise TypeError(
                    f"log_metrics: metrics[{key!r}] has the key {name!r}; a dict value maps "
                    "names (strings) to numbers."
                )
        return {name: _number(f"{key!r}][{name!r}", v) for name, v in value.items()}
    return _number(repr(key), value)


def _check_trackers(function: str, trackers: Any) -> Sequence[Tracker]:
    if type(trackers) in (list, tuple):  # the usual case, checked first: it runs every step
        return trackers  # type: ignore[no-any-return]
    # isinstance against a runtime-checkable Protocol costs tens of microseconds on 3.11.
    if isinstance(trackers, Tracker) or not isinstance(trackers, Sequence):
        raise TypeError(
            f"{function}: trackers={trackers!r} must be a list or tuple of trackers. "
            f"Pass trackers=[tracker]."
        )
    return trackers


def log_metrics(
    ctx: RunContext, metrics: Mapping[str, Any], *, step: int, trackers: Sequence[Tracker]
) -> None:
    """Record `metrics` at `step` in every tracker, on the main process only.

    Other ranks return at once without reading `metrics`, so pass values that are already
    the same on every rank (for example reduced with `accel.reduce`) when that matters.

    Args:
        ctx: the run context; only `ctx.is_main` logs.
        metrics: metric name to a number, a one-element tensor (read with `.item()`), a
            string, or a dict of names to numbers (what Accelerate's trackers accept; each
            tracker stores it in its own form, docs/tracking.md). A metric named "step" is
            logged as a metric, as Accelerate logs it; `step=` stays the step.
        step: the step the values belong to, an int >= 0 (usually the optimizer step).
        trackers: the trackers to write to, e.g. `[JSONLTracker("out/metrics.jsonl")]`.

    Raises:
        TypeError: for a value that is none of those, or `trackers` that is not a sequence.
        ValueError: for a negative step, a tensor with several elements, or a reserved name.

    Example:
        >>> from accel import JSONLTracker, RunContext, log_metrics
        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
        >>> with JSONLTracker(path) as tracker:
        ...     log_metrics(RunContext.single(), {"loss": 0.5}, step=1, trackers=[tracker])
        >>> path.read_text()
        '{"step": 1, "loss": 0.5}\\n'
    """
    trackers = _check_trackers("log_metrics", trackers)
    if not ctx.is_main:
        return
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"log_metrics: step={step!r} must be an int >= 0, e.g. step=global_step.")
    values: dict[str, Any] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or key in _RESERVED:
            raise ValueError(
                f"log_metrics: metric name {key!r} is not allowed; names are strings other than "
                f"{sorted(_RESERVED)}. Rename the metric."
            )
        values[key] = _value(key, value)
    for tracker in trackers:  # every tracker's rules first: a record goes to all or to none
        check = getattr(tracker, "check_log", None)
        if check is not None:
            check(values, step=step)
    for tracker in trackers:
        tracker.log(values, step=step)


def log_hparams(
    ctx: RunContext, hparams: Mapping[str, Any], *, trackers: Sequence[Tracker]
) -> None:
    """Store the run's hyper-parameters once in every tracker, on the main process only.

    Args:
        ctx: the run context; only `ctx.is_main` writes.
        hparams: names to values; JSON values are kept as they are, anything else is stored
            as its `str()`. Nested mappings are kept as they are in JSONL.
        trackers: the trackers to write to.

    Raises:
        RuntimeError: when a tracker already stored hyper-parameters (once per run).

    Example:
        >>> from accel import JSONLTracker, RunContext, log_hparams
        >>> import json, tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
        >>> with JSONLTracker(path) as tracker:
        ...     log_hparams(RunContext.single(), {"lr": 3e-4, "layers": 2}, trackers=[tracker])
        >>> json.loads(path.read_text())
        {'hparams': {'lr': 0.0003, 'layers': 2}}
    """
    trackers = _check_trackers("log_hparams", trackers)
    if not ctx.is_main:
        return
    if not isinstance(hparams, Mapping):
        raise TypeError(f"log_hparams: hparams={hparams!r} must be a mapping of names to values.")
    for tracker in trackers:
        tracker.log_hparams(hparams)


class _OffMainTracker:
    """What other ranks get from `init_trackers`: the tracker's place in the list, writing
    nothing (the real one exists on the main process only)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        pass

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def register_tracker(
    name: str,
    factory: TrackerFactory,
    *,
    registry: Mapping[str, TrackerFactory] | None = None,
) -> Mapping[str, TrackerFactory]:
    """Return a new tracker registry: `registry` plus `factory` under `name`.

    The counterpart of Accelerate's `register_tracker_class`, without a process-wide table:
    pass the returned registry to `init_trackers(..., registry=...)`. `registry` is unchanged.

    Args:
        name: the name `init_trackers` will know it by; not one `registry` already has.
        factory: called as `factory(project=..., directory=...)` on the main process to build
            the tracker (a class with that `__init__` is a factory).
        registry: the registry to extend; None: `BUILTIN_TRACKERS`.

    Returns:
        An immutable mapping of names to factories.

    Raises:
        ValueError: for a name `registry` already has, or one that is not a plain name.
        TypeError: when `factory` is not callable.

    Example:
        >>> from accel import BUILTIN_TRACKERS, RunContext, init_trackers, log_metrics
        >>> from accel import register_tracker
        >>> class PrintTracker:
        ...     def __init__(self, *, project, directory):
        ...         self.project = project
        ...     def log(self, metrics, *, step): print(step, dict(metrics))
        ...     def log_hparams(self, hparams): pass
        ...     def close(self): pass
        >>> registry = register_tracker("print", PrintTracker)
        >>> trackers = init_trackers(RunContext.single(), ["print"], project="demo",
        ...                          registry=registry)
        >>> log_metrics(RunContext.single(), {"loss": 0.5}, step=3, trackers=trackers)
        3 {'loss': 0.5}
        >>> "print" in BUILTIN_TRACKERS
        False
    """
    check_tracker_name("register_tracker", name)
    registry = BUILTIN_TRACKERS if registry is None else registry
    if ":" in name or name in registry:
        problem = "is already registered" if name in registry else "contains ':'"
        raise ValueError(
            f"register_tracker: name={name!r} {problem}; names are unique and ':' marks import "
            f"paths. Pick another name (taken: {sorted(registry)})."
        )
    if not callable(factory):
        raise TypeError(
            f"register_tracker: factory={factory!r} is not callable; pass a class or function "
            "called as factory(project=..., directory=...)."
        )
    return MappingProxyType({**registry, name: factory})


def init_trackers(
    ctx: RunContext,
    names: Sequence[str] | None,
    *,
    project: str,
    config: Mapping[str, Any] | None = None,
    directory: str | os.PathLike[str] | None = None,
    registry: Mapping[str, TrackerFactory] | None = None,
) -> list[Tracker]:
    """Build the trackers `names` asks for (Accelerate's `log_with` + `init_trackers`).

    The main process builds each by its factory and stores `config` in it as the run's
    hyper-parameters; other ranks get stand-ins that write nothing, in the same places, so
    `trackers[i]` means the same tracker on every rank and no service sees rank 1.

    Args:
        ctx: the run context; only `ctx.is_main` builds real trackers.
        names: tracker names in order (None: `ctx.log_with`, the config's `log_with` or
            `accel launch --log_with`): "jsonl", "tensorboard", "wandb", "mlflow", "trackio",
            a name in `registry`, or "package.module:Factory" (imported by its path).
        project: the project (W&B project, MLflow experiment, trackio project; the folder
            under `directory` for the file trackers).
        config: the run's hyper-parameters, stored once in every tracker.
        directory: where trackers write: `directory/project/metrics.jsonl`,
            `directory/project/tensorboard`, wandb's `dir`, MLflow's `directory/mlruns` file
            store. None: each service's own default (the file trackers need one).
        registry: names to factories, one from `register_tracker`; None: `BUILTIN_TRACKERS`.

    Returns:
        One tracker per name, in order; close them at the end (Accelerate's `end_training`).

    Raises:
        ValueError: for an unknown or repeated name, or a setting a tracker cannot honour.
        ImportError: when a tracker's optional package is missing, naming the extra.

    Example:
        >>> from accel import RunContext, init_trackers, log_metrics
        >>> import json, tempfile, pathlib
        >>> out = pathlib.Path(tempfile.mkdtemp())
        >>> ctx = RunContext.single()
        >>> trackers = init_trackers(ctx, ["jsonl"], project="demo", config={"lr": 0.1},
        ...                          directory=out)
        >>> log_metrics(ctx, {"loss": 0.5}, step=0, trackers=trackers)
        >>> for tracker in trackers:
        ...     tracker.close()
        >>> (out / "demo" / "metrics.jsonl").read_text().splitlines()
        ['{"hparams": {"lr": 0.1}}', '{"step": 0, "loss": 0.5}']
    """
    if names is None:
        if not ctx.log_with:
            raise ValueError(
                "init_trackers: names=None and the run's config names no trackers "
                "(ctx.log_with is empty); pass names=['jsonl'], or set log_with in the config "
                "file or `accel launch --log_with jsonl`."
            )
        names = ctx.log_with
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise TypeError(
            f"init_trackers: names={names!r} must be a list of tracker names, e.g. ['wandb']."
        )
    for name in names:
        check_tracker_name("init_trackers", name)
    if len(set(names)) != len(names):
        raise ValueError(f"init_trackers: names={list(names)!r} repeats a name; list each once.")
    if not isinstance(project, str) or not project:
        raise ValueError(f"init_trackers: project={project!r} must be a non-empty string.")
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(f"init_trackers: config={config!r} must be a mapping of names to values.")
    registry = BUILTIN_TRACKERS if registry is None else registry
    factories = [resolve(name, registry) for name in names]  # unknown names fail on every rank
    if not ctx.is_main:
        return [_OffMainTracker(name) for name in names]
    folder = as_directory(directory)
    trackers: list[Tracker] = []
    for name, factory in zip(names, factories, strict=True):
        tracker = factory(project=project, directory=folder)
        if not isinstance(tracker, Tracker):
            raise TypeError(
                f"init_trackers: {name!r} built {tracker!r}, which lacks log, log_hparams or "
                "close; a tracker follows accel.Tracker."
            )
        trackers.append(tracker)
    if config is not None:
        log_hparams(ctx, config, trackers=trackers)
    return trackers
