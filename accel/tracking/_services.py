"""Trackers that write to an experiment service: Weights & Biases, MLflow and trackio.

Each imports its library only when created (on the process that creates it) and starts its run
at the first write, so creating one on every rank is as harmless as creating a `JSONLTracker`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from accel.tracking._files import OnceTracker, jsonable


def _missing(tracker: str, package: str) -> str:
    return (
        f"{tracker} needs the optional '{package}' package, which is not installed. Install it "
        f"with `pip install {package}` (or `pip install -e '.[{package}]'` in accel's checkout)."
    )


# MLflow says at INFO, on every run with a new local store (what `directory=` gives), that it
# creates and updates the store's tables: the tracker's own plumbing, not the user's news.
_MLFLOW_STORE_LOGGER = "mlflow.store.db.utils"


def _not_info(record: logging.LogRecord) -> bool:
    return record.levelno > logging.INFO


@contextlib.contextmanager
def _quiet_store() -> Iterator[None]:
    """Drop the INFO records of MLflow's store set-up while the tracker opens its store (a
    filter on that one logger, removed after: levels and handlers stay the user's)."""
    logger = logging.getLogger(_MLFLOW_STORE_LOGGER)
    logger.addFilter(_not_info)
    try:
        yield
    finally:
        logger.removeFilter(_not_info)


def _flat(hparams: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    # Services that keep one value per name get nested settings as "optimizer/lr".
    out: dict[str, Any] = {}
    for key, value in hparams.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{name}/"))
        else:
            out[name] = jsonable(value)
    return out


class WandbTracker(OnceTracker):
    """Log to a Weights & Biases run of `project` (needs the optional `wandb` package).

    The run starts at the first write (`wandb.init(project=..., dir=directory, name=run_name)`),
    so `WANDB_MODE=offline` and the other `WANDB_*` variables apply as in any wandb script.
    Hyper-parameters go to the run's config; `run` is the `wandb.Run` once started.

    Raises:
        ImportError: when `wandb` is not installed, naming the extra to install.

    Example:
        >>> from accel import WandbTracker
        >>> tracker = WandbTracker("demo")  # doctest: +SKIP
        >>> tracker.log({"loss": 0.5}, step=0)  # doctest: +SKIP
        >>> tracker.close()  # doctest: +SKIP
    """

    def __init__(
        self,
        project: str,
        *,
        directory: str | os.PathLike[str] | None = None,
        run_name: str | None = None,
    ) -> None:
        super().__init__("WandbTracker")
        try:
            import wandb  # noqa: F401  (fail here, not at the first log)
        except ImportError as err:
            raise ImportError(_missing("WandbTracker", "wandb")) from err
        self.project = project
        self.directory = None if directory is None else Path(directory)
        self.run_name = run_name
        self.run: Any = None

    def _get_run(self) -> Any:
        self._check_open()
        if self.run is None:
            import wandb

            if self.directory is not None:
                self.directory.mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(
                project=self.project,
                dir=None if self.directory is None else str(self.directory),
                name=self.run_name,
            )
        return self.run

    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        self._get_run().log(dict(metrics), step=step)

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        self._claim_hparams()
        self._get_run().config.update(jsonable(hparams))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
        super().close()


class MLflowTracker(OnceTracker):
    """Log to an MLflow run in the experiment named `project` (needs the optional `mlflow`
    package, or `mlflow-skinny`).

    Writes through `mlflow.MlflowClient(tracking_uri)`, never MLflow's process-wide active run:
    `tracking_uri=None` is MLflow's own default (`MLFLOW_TRACKING_URI`, else its local store);
    a local store is a SQLite file, `"sqlite:///path/mlflow.db"`.
    The experiment is created if missing; the run starts at the first write and is marked
    finished by `close()`. Hyper-parameters are MLflow params (nested ones as "a/b"; values
    as text); `run_id` names the run once started.

    Raises:
        ImportError: when `mlflow` is not installed, naming the extra to install.

    Example:
        >>> from accel import MLflowTracker
        >>> tracker = MLflowTracker("demo", tracking_uri="sqlite:///mlflow.db")  # doctest: +SKIP
        >>> tracker.log({"loss": 0.5}, step=0)  # doctest: +SKIP
        >>> tracker.close()  # doctest: +SKIP
    """

    def __init__(
        self, project: str, *, tracking_uri: str | None = None, run_name: str | None = None
    ) -> None:
        super().__init__("MLflowTracker")
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as err:
            raise ImportError(_missing("MLflowTracker", "mlflow")) from err
        self.project = project
        self.run_name = run_name
        with _quiet_store():  # a local store's tables may be made here
            self.client: Any = MlflowClient(tracking_uri=tracking_uri)
        self.run_id: str | None = None

    def _get_run_id(self) -> str:
        self._check_open()
        if self.run_id is None:
            with _quiet_store():  # or at the first call, which opens the store
                found = self.client.get_experiment_by_name(self.project)
            experiment = (
                found.experiment_id if found else self.client.create_experiment(self.project)
            )
            self.run_id = self.client.create_run(experiment, run_name=self.run_name).info.run_id
        return self.run_id

    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        from mlflow.entities import Metric

        # MLflow keeps numbers only: a dict value becomes one metric per key ("accuracy/f1");
        # a string cannot be a metric (Accelerate drops it with a warning, as here).
        numbers: dict[str, Any] = {}
        for key, value in metrics.items():
            if isinstance(value, str):
                warnings.warn(
                    f"MLflowTracker: metrics[{key!r}]={value!r} is a string, which MLflow cannot "
                    "store as a metric; it is not logged. Log it as a tag or a parameter.",
                    stacklevel=3,
                )
            elif isinstance(value, Mapping):
                numbers.update((f"{key}/{name}", v) for name, v in value.items())
            else:
                numbers[key] = value
        run_id = self._get_run_id()
        now = int(time.time() * 1000)
        batch = [Metric(key, float(value), now, step) for key, value in numbers.items()]
        self.client.log_batch(run_id, metrics=batch, synchronous=True)

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        self._claim_hparams()
        run_id = self._get_run_id()
        params = [Param(key, str(value)) for key, value in _flat(hparams).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(run_id, params=params[start : start + 100], synchronous=True)

    def close(self) -> None:
        if self.run_id is not None and not self._closed:
            self.client.set_terminated(self.run_id)
        super().close()


class TrackioTracker(OnceTracker):
    """Log to a local trackio run of `project` (needs the optional `trackio` package).

    trackio keeps every project in `$TRACKIO_DIR` (by default `~/.cache/huggingface/trackio`);
    set that variable before the run to store it elsewhere. The run starts at the first write,
    with the hyper-parameters as its config when `log_hparams` comes first (as
    `init_trackers` does); `run` is the `trackio.Run` once started.

    Raises:
        ImportError: when `trackio` is not installed, naming the extra to install.
        RuntimeError: from `log_hparams` after the run started (trackio stores its config once,
            when the run starts).

    Example:
        >>> from accel import TrackioTracker
        >>> tracker = TrackioTracker("demo")  # doctest: +SKIP
        >>> tracker.log({"loss": 0.5}, step=0)  # doctest: +SKIP
        >>> tracker.close()  # doctest: +SKIP
    """

    def __init__(self, project: str, *, run_name: str | None = None) -> None:
        super().__init__("TrackioTracker")
        try:
            import trackio  # noqa: F401  (fail here, not at the first log)
        except ImportError as err:
            raise ImportError(_missing("TrackioTracker", "trackio")) from err
        self.project = project
        self.run_name = run_name
        self.run: Any = None

    def _start(self, config: Mapping[str, Any] | None) -> Any:
        self._check_open()
        if self.run is None:
            import trackio

            self.run = trackio.init(
                project=self.project,
                name=self.run_name,
                config=None if config is None else dict(config),
            )
        return self.run

    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        self._start(None).log(dict(metrics), step=step)

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        self._claim_hparams()
        if self.run is not None:
            raise RuntimeError(
                "TrackioTracker: log_hparams after the first log; trackio stores a run's config "
                "when it starts. Call log_hparams before log_metrics."
            )
        self._start(jsonable(hparams))

    def close(self) -> None:
        if self.run is not None and not self._closed:
            self.run.finish()
        super().close()
