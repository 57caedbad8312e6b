"""Metrics, hyper-parameters and progress bars, written by the main process only.

Trackers are plain objects the user creates, passes to `log_metrics` / `log_hparams`, and
closes (or uses as context managers). Every rank may create them: nothing touches the disk until
the main process logs, so the same line of code runs unchanged on every rank. Optional packages
(`tensorboard`, `tqdm`) are imported only when a tracker or bar that needs them is created.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Protocol, TypeVar, runtime_checkable

import torch
from typing_extensions import Self

from accel.context import RunContext

__all__ = [
    "JSONLTracker",
    "TensorBoardTracker",
    "Tracker",
    "log_hparams",
    "log_metrics",
    "progress",
]

T = TypeVar("T")

# Keys of a JSONL record that carry accel's own data, so no metric may use them.
_RESERVED = frozenset({"step", "hparams"})


@runtime_checkable
class Tracker(Protocol):
    """What `log_metrics` and `log_hparams` need from a tracker; write your own to plug in
    another service (wandb, MLflow, ...)."""

    def log(self, metrics: Mapping[str, float], *, step: int) -> None:
        """Record `metrics` (name to number) at `step`."""

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        """Record the run's hyper-parameters (called at most once per tracker)."""

    def close(self) -> None:
        """Flush and release files; further logging is an error."""


def _number(key: str, value: Any) -> float | int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"log_metrics: metrics[{key!r}] is a tensor of shape {tuple(value.shape)}; "
                f"expected one number. Reduce it first, e.g. {key}=loss.mean()."
            )
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"log_metrics: metrics[{key!r}]={value!r} is a {type(value).__name__}; expected a "
            "number or a one-element tensor."
        )
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _check_trackers(function: str, trackers: Any) -> Sequence[Tracker]:
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
        metrics: metric name to a number or a one-element tensor (read with `.item()`).
        step: the step the values belong to, an int >= 0 (usually the optimizer step).
        trackers: the trackers to write to, e.g. `[JSONLTracker("out/metrics.jsonl")]`.

    Raises:
        TypeError: for a value that is not a number, or `trackers` that is not a sequence.
        ValueError: for a negative step, a tensor with several elements, or a reserved name.

    Example:
        >>> from accel import JSONLTracker, log_metrics, RunContext
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
    values: dict[str, float | int] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or key in _RESERVED:
            raise ValueError(
                f"log_metrics: metric name {key!r} is not allowed; names are strings other than "
                f"{sorted(_RESERVED)}. Rename the metric."
            )
        values[key] = _number(key, value)
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
        >>> from accel import JSONLTracker, log_hparams, RunContext
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


def _jsonable(value: Any) -> Any:
    # Keep JSON's own types; store anything else (paths, dtypes, devices) as its text.
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


class _OnceTracker:
    """Shared bookkeeping: refuse logging after close and a second set of hyper-parameters."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._closed = False
        self._has_hparams = False

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self._name}: the tracker is closed; create a new one to log.")

    def _claim_hparams(self) -> None:
        self._check_open()
        if self._has_hparams:
            raise RuntimeError(
                f"{self._name}: hyper-parameters were already stored for this run; call "
                "log_hparams once, with every hyper-parameter."
            )
        self._has_hparams = True

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True


class JSONLTracker(_OnceTracker):
    """Append one JSON object a line to `path`: `{"step": 3, "loss": 0.25}` per `log` call and
    `{"hparams": {...}}` for `log_hparams`. Each line is flushed as it is written.

    The file (and its folder) is created at the first write, so creating the tracker on every
    rank is harmless; an existing file is appended to, which is what a resumed run wants.

    Example:
        >>> from accel import JSONLTracker
        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "run" / "metrics.jsonl"
        >>> tracker = JSONLTracker(path)
        >>> tracker.log({"loss": 1.5, "lr": 0.1}, step=0)
        >>> tracker.close()
        >>> path.read_text()
        '{"step": 0, "loss": 1.5, "lr": 0.1}\\n'
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__("JSONLTracker")
        self.path = Path(path)
        self._file: IO[str] | None = None

    def _write(self, record: Mapping[str, Any]) -> None:
        self._check_open()
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def log(self, metrics: Mapping[str, float], *, step: int) -> None:
        self._write({"step": step, **{k: _jsonable(v) for k, v in metrics.items()}})

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        self._claim_hparams()
        self._write({"hparams": _jsonable(hparams)})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        super().close()


_TENSORBOARD_MISSING = (
    "TensorBoardTracker needs the optional 'tensorboard' package, which is not installed. "
    "Install it with `pip install 'accel-train[tensorboard]'` (or `pip install tensorboard`), "
    "or use JSONLTracker."
)


class TensorBoardTracker(_OnceTracker):
    """Write scalars and hyper-parameters to a TensorBoard event file in `log_dir`, through
    `torch.utils.tensorboard` (needs the optional `tensorboard` package).

    The event file is created at the first write, so creating the tracker on every rank is
    harmless. Each call is flushed, so TensorBoard shows it at once.

    Raises:
        ImportError: when `tensorboard` is not installed, naming the extra to install.

    Example:
        >>> from accel import TensorBoardTracker
        >>> import tempfile
        >>> tracker = TensorBoardTracker(tempfile.mkdtemp())
        >>> tracker.log({"loss": 0.5}, step=1)
        >>> tracker.close()
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        super().__init__("TensorBoardTracker")
        try:
            import torch.utils.tensorboard  # noqa: F401  (fail here, not at the first log)
        except ImportError as err:
            raise ImportError(_TENSORBOARD_MISSING) from err
        self.log_dir = Path(log_dir)
        self._writer: Any = None

    def _get_writer(self) -> Any:
        self._check_open()
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        return self._writer

    def log(self, metrics: Mapping[str, float], *, step: int) -> None:
        writer = self._get_writer()
        for key, value in metrics.items():
            writer.add_scalar(key, value, global_step=step)
        writer.flush()

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        self._claim_hparams()
        writer = self._get_writer()
        # TensorBoard's HPARAMS tab takes numbers, strings and booleans; store the rest as
        # text. Written into this run's own event file (SummaryWriter.add_hparams would start
        # a new sub-run).
        flat = {
            k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in hparams.items()
        }
        for summary in hparams_summary(flat, {}):  # type: ignore[no-untyped-call]
            writer.file_writer.add_summary(summary)
        writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        super().close()


class _SilentBar(Iterable[T]):
    """A progress bar that draws nothing, with tqdm's methods (used when tqdm is not installed)."""

    def __init__(self, iterable: Iterable[T], total: int | None = None) -> None:
        self.iterable = iterable
        self.total = total if total is not None else _length(iterable)
        self.n = 0

    def __iter__(self) -> Iterator[T]:
        for item in self.iterable:
            yield item
            self.n += 1

    def __len__(self) -> int:
        if self.total is None:
            raise TypeError(f"progress: {type(self.iterable).__name__} has no len(); pass total=")
        return self.total

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        self.n += int(n)

    def reset(self, total: int | None = None) -> None:
        self.n, self.total = 0, total if total is not None else self.total

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None: ...
    def set_description_str(self, desc: str | None = None, refresh: bool = True) -> None: ...
    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kw: Any) -> None: ...
    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None: ...
    def refresh(self) -> None: ...
    def clear(self) -> None: ...
    def close(self) -> None: ...


def _length(iterable: Iterable[Any]) -> int | None:
    try:
        return len(iterable)  # type: ignore[arg-type]
    except TypeError:
        return None


def progress(
    ctx: RunContext,
    iterable: Iterable[T],
    *,
    desc: str | None = None,
    total: float | None = None,
    leave: bool = True,
    unit: str = "it",
    file: IO[str] | None = None,
    mininterval: float = 0.1,
    disable: bool = False,
) -> Any:
    """Show a tqdm progress bar over `iterable` on the main process; a silent one elsewhere.

    Every rank gets a bar with tqdm's methods (`update`, `set_postfix`, `set_description`,
    `close`, use as a context manager), so a loop ported from Accelerate that calls
    `bar.update(1)` runs unchanged on every rank; only the main process draws. Without tqdm
    every rank gets a silent bar and the main process warns once per call.

    Args:
        ctx: the run context; only `ctx.is_main` shows a bar.
        iterable: what to iterate over (a loader, a range, ...).
        desc: the bar's label.
        total: the number of items, when `iterable` has no `len()`.
        leave: keep the finished bar on screen.
        unit: the name of one item.
        file: where the bar is written (tqdm's default, stderr, when None).
        mininterval: the least seconds between two redraws.
        disable: show no bar (and still iterate).

    Returns:
        A tqdm bar wrapping `iterable` (disabled on other ranks), or a silent bar with the
        same methods when tqdm is not installed.

    Example:
        >>> from accel import progress, RunContext
        >>> ctx = RunContext(rank=1, world_size=2)
        >>> bar = progress(ctx, range(4), desc="steps")
        >>> sum(bar), bar.update(1)
        (6, None)
    """
    try:
        from tqdm import tqdm  # optional dependency
    except ImportError:
        if ctx.is_main:
            warnings.warn(
                "progress: tqdm is not installed, so no progress bar is shown; install it with "
                "`pip install 'accel-train[tqdm]'`.",
                stacklevel=2,
            )
        return _SilentBar(iterable, None if total is None else int(total))
    return tqdm(
        iterable,
        desc=desc,
        total=total,
        leave=leave,
        unit=unit,
        file=file,
        mininterval=mininterval,
        disable=disable or not ctx.is_main,
    )
