"""The trackers that write files: JSONL lines and TensorBoard event files."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from typing_extensions import Self


def jsonable(value: Any) -> Any:
    # Keep JSON's own types; store anything else (paths, dtypes, devices) as its text.
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return str(value)


# Where a JSONL line keeps a metric named "step" that is not the line's step.
_STEP_METRIC = "__step"


class OnceTracker:
    """Shared bookkeeping: refuse logging after close and a second set of hyper-parameters."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._closed = False
        self._has_hparams = False

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self._name}: the tracker is closed; create a new one to log.")

    def check_log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        """Raise what `log(metrics, step=step)` would, writing nothing: `log_metrics` asks
        every tracker before any writes, so a record is in all of them or in none."""
        self._check_open()

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


class JSONLTracker(OnceTracker):
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

    def check_log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        super().check_log(metrics, step=step)
        if _STEP_METRIC in metrics and "step" in metrics and metrics["step"] != step:
            raise ValueError(
                f"JSONLTracker: metrics[{_STEP_METRIC!r}] is also where a metric named 'step' "
                f"that differs from step= is kept (metrics['step']={metrics['step']!r}, "
                f"step={step!r}); rename one of the two metrics."
            )

    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        # A metric named "step" (Accelerate's scripts log one) shares the line's "step" key:
        # equal to step=, it is that key; otherwise it is kept beside it as "__step" (trackio's
        # name for it). A dict value is stored as a JSON object.
        self.check_log(metrics, step=step)
        line = {"step": step, **{k: jsonable(v) for k, v in metrics.items() if k != "step"}}
        if "step" in metrics and metrics["step"] != step:
            line[_STEP_METRIC] = jsonable(metrics["step"])
        self._write(line)

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        self._claim_hparams()
        self._write({"hparams": jsonable(hparams)})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        super().close()


_TENSORBOARD_MISSING = (
    "TensorBoardTracker needs the optional 'tensorboard' package, which is not installed. "
    "Install it with `pip install tensorboard` (or `pip install -e '.[tensorboard]'` in accel's "
    "checkout), or use JSONLTracker."
)


class TensorBoardTracker(OnceTracker):
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

    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        # Accelerate's forms: numbers as scalars, strings as text, a dict through add_scalars
        # (one sub-run folder per key, `log_dir/<name>_<key>`, drawn on one chart).
        writer = self._get_writer()
        for key, value in metrics.items():
            if isinstance(value, str):
                writer.add_text(key, value, global_step=step)
            elif isinstance(value, Mapping):
                writer.add_scalars(key, dict(value), global_step=step)
            else:
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
