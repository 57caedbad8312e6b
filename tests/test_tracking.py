"""Trackers and progress bars on hand-built contexts: exact file contents, main-only writes."""

from __future__ import annotations

import dataclasses
import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from accel import (
    BUILTIN_TRACKERS,
    Config,
    JSONLTracker,
    RunContext,
    TensorBoardTracker,
    Tracker,
    init_trackers,
    load_config,
    log_hparams,
    log_metrics,
    progress,
    register_tracker,
)
from accel.config import env_settings, parse_config
from tests import tracker_plugin

MAIN = RunContext(rank=0, world_size=2, device=torch.device("cpu"))
OTHER = RunContext(rank=1, world_size=2, device=torch.device("cpu"))


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_appends_one_flushed_object_per_call(tmp_path: Path) -> None:
    path = tmp_path / "out" / "metrics.jsonl"
    tracker = JSONLTracker(path)
    assert not path.exists()  # nothing is created before the first write
    log_hparams(MAIN, {"lr": 0.5, "layers": 2, "dtype": torch.bfloat16}, trackers=[tracker])
    log_metrics(MAIN, {"loss": torch.tensor(0.25), "n": 3}, step=0, trackers=[tracker])
    log_metrics(MAIN, {"loss": torch.tensor([0.125])}, step=7, trackers=[tracker])
    # Flushed per call: readable while the tracker is still open.
    assert _lines(path) == [
        {"hparams": {"lr": 0.5, "layers": 2, "dtype": "torch.bfloat16"}},
        {"step": 0, "loss": 0.25, "n": 3},
        {"step": 7, "loss": 0.125},
    ]
    tracker.close()
    with JSONLTracker(path) as again:  # a resumed run appends
        log_metrics(MAIN, {"loss": 0.0625}, step=8, trackers=[again])
    assert _lines(path)[-1] == {"step": 8, "loss": 0.0625}
    assert len(_lines(path)) == 4


def test_other_ranks_write_nothing(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    with JSONLTracker(path) as tracker:
        log_hparams(OTHER, {"lr": 1}, trackers=[tracker])
        log_metrics(OTHER, {"loss": "not even checked"}, step=-1, trackers=[tracker])
    assert not path.exists()


def test_hparams_are_stored_once_and_closed_trackers_refuse(tmp_path: Path) -> None:
    tracker = JSONLTracker(tmp_path / "m.jsonl")
    log_hparams(MAIN, {"lr": 1}, trackers=[tracker])
    with pytest.raises(RuntimeError, match="hyper-parameters were already stored"):
        log_hparams(MAIN, {"lr": 2}, trackers=[tracker])
    tracker.close()
    with pytest.raises(RuntimeError, match="JSONLTracker: the tracker is closed"):
        log_metrics(MAIN, {"loss": 1.0}, step=0, trackers=[tracker])
    assert _lines(tmp_path / "m.jsonl") == [{"hparams": {"lr": 1}}]


@pytest.mark.parametrize(
    ("metrics", "step", "error", "message"),
    [
        ({"loss": [1]}, 0, TypeError, r"metrics\['loss'\]=\[1\] is a list; expected a number"),
        ({"acc": {"f1": "x"}}, 0, TypeError, r"metrics\['acc'\]\['f1'\]='x' is a str"),
        ({"acc": {1: 0.5}}, 0, TypeError, r"metrics\['acc'\] has the key 1"),
        ({"loss": torch.ones(2)}, 0, ValueError, r"tensor of shape \(2,\); expected one number"),
        ({"loss": 1.0}, -1, ValueError, "step=-1 must be an int >= 0"),
        ({"loss": 1.0}, True, ValueError, "step=True must be an int >= 0"),
        ({"hparams": 1.0}, 0, ValueError, "metric name 'hparams' is not allowed"),
    ],
)
def test_bad_metrics_name_the_value(
    tmp_path: Path, metrics: dict, step: int, error: type[Exception], message: str
) -> None:
    with JSONLTracker(tmp_path / "m.jsonl") as tracker, pytest.raises(error, match=message):
        log_metrics(MAIN, metrics, step=step, trackers=[tracker])
    assert not (tmp_path / "m.jsonl").exists()


def test_a_step_metric_other_than_step_reaches_every_tracker_named_apart(tmp_path: Path) -> None:
    """Issue 44 item 4: JSONL refused a `step` metric that differs from step=, after
    TensorBoard had written the same record. Now every tracker takes it, as Accelerate's do;
    JSONL keeps both, the metric as `__step` (trackio's name for it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with TensorBoardTracker(tmp_path / "tb") as board, JSONLTracker(tmp_path / "m.jsonl") as j:
        log_metrics(MAIN, {"loss": 0.5, "step": 3}, step=7, trackers=[board, j])
    assert _lines(tmp_path / "m.jsonl") == [{"step": 7, "__step": 3, "loss": 0.5}]
    (events_file,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    events = EventAccumulator(str(events_file))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("step")] == [(7, 3.0)]


def test_every_trackers_rules_are_checked_before_any_writes(tmp_path: Path) -> None:
    first, closed = JSONLTracker(tmp_path / "a.jsonl"), JSONLTracker(tmp_path / "b.jsonl")
    closed.close()
    with pytest.raises(RuntimeError, match="the tracker is closed"):
        log_metrics(MAIN, {"loss": 0.5}, step=0, trackers=[first, closed])
    assert not (tmp_path / "a.jsonl").exists()  # the record is in no tracker, not in some
    with pytest.raises(ValueError, match=r"metrics\['__step'\].*named 'step'"):
        log_metrics(MAIN, {"step": 1, "__step": 2}, step=0, trackers=[first])
    assert not (tmp_path / "a.jsonl").exists()
    first.close()


def test_accelerates_values_reach_jsonl_and_custom_trackers(tmp_path: Path) -> None:
    # The no_trainer scripts log a metric named "step" with step= the same, and GLUE's a dict.
    recorder = _Recorder()
    with JSONLTracker(tmp_path / "m.jsonl") as tracker:
        metrics = {"accuracy": {"accuracy": 0.75, "f1": torch.tensor(0.5)}, "note": "ok",
                   "epoch": 0, "step": 6}  # fmt: skip
        log_metrics(MAIN, metrics, step=6, trackers=[tracker, recorder])
    assert _lines(tmp_path / "m.jsonl") == [
        {"step": 6, "accuracy": {"accuracy": 0.75, "f1": 0.5}, "note": "ok", "epoch": 0}
    ]
    assert recorder.calls == [("log", 6, {**metrics, "accuracy": {"accuracy": 0.75, "f1": 0.5}})]


def test_trackers_must_be_a_sequence(tmp_path: Path) -> None:
    tracker = JSONLTracker(tmp_path / "m.jsonl")
    assert isinstance(tracker, Tracker)
    with pytest.raises(TypeError, match=r"must be a list or tuple of trackers. Pass trackers="):
        log_metrics(MAIN, {"loss": 1.0}, step=0, trackers=tracker)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="log_hparams: trackers="):
        log_hparams(OTHER, {}, trackers=tracker)  # type: ignore[arg-type]


class _Recorder:
    """A user-written tracker: anything with log, log_hparams and close plugs in."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def log(self, metrics: dict, *, step: int) -> None:
        self.calls.append(("log", step, dict(metrics)))

    def log_hparams(self, hparams: dict) -> None:
        self.calls.append(("hparams", dict(hparams)))

    def close(self) -> None:
        self.calls.append(("close",))


def test_custom_trackers_get_plain_numbers() -> None:
    first, second = _Recorder(), _Recorder()
    log_metrics(MAIN, {"acc": torch.tensor(3)}, step=2, trackers=(first, second))
    log_hparams(MAIN, {"seed": 1}, trackers=[first])
    assert first.calls == [("log", 2, {"acc": 3}), ("hparams", {"seed": 1})]
    assert second.calls == [("log", 2, {"acc": 3})]
    assert type(first.calls[0][2]["acc"]) is int


def _read_events(folder: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, object]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    (event_file,) = folder.glob("events.out.tfevents.*")
    events = EventAccumulator(str(event_file))
    events.Reload()
    scalars = {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }
    hparams: dict[str, object] = {}
    for content in events.PluginTagToContent("hparams").values():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        for name, value in data.session_start_info.hparams.items():
            hparams[name] = (
                value.number_value
                if value.HasField("number_value")
                else (value.string_value if value.HasField("string_value") else value.bool_value)
            )
    return scalars, hparams


def test_tensorboard_event_file_reads_back(tmp_path: Path) -> None:
    folder = tmp_path / "tb"
    with TensorBoardTracker(folder) as tracker:
        assert not folder.exists()  # created at the first write
        log_hparams(MAIN, {"lr": 0.5, "opt": "adam", "ema": True, "dev": "cpu"}, trackers=[tracker])
        for step, loss in ((0, 2.0), (1, 1.5), (5, 0.25)):
            log_metrics(
                MAIN, {"loss": torch.tensor(loss), "lr": 0.5}, step=step, trackers=[tracker]
            )
    scalars, hparams = _read_events(folder)
    assert scalars == {
        "loss": [(0, 2.0), (1, 1.5), (5, 0.25)],
        "lr": [(0, 0.5), (1, 0.5), (5, 0.5)],
    }
    assert hparams == {"lr": 0.5, "opt": "adam", "ema": True, "dev": "cpu"}


def test_tensorboard_takes_accelerates_dicts_and_strings(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = tmp_path / "tb"
    with TensorBoardTracker(folder) as tracker:
        metrics = {"accuracy": {"accuracy": 0.75, "f1": 0.5}, "note": "ok", "step": 6}
        log_metrics(MAIN, metrics, step=6, trackers=[tracker])

    def read(folder: Path) -> Any:
        (events_file,) = folder.glob("events.out.tfevents.*")
        events = EventAccumulator(str(events_file))
        events.Reload()
        return events

    events = read(folder)
    assert [(e.step, e.value) for e in events.Scalars("step")] == [(6, 6.0)]
    assert [(e.step, e.tensor_proto.string_val) for e in events.Tensors("note/text_summary")] == [
        (6, [b"ok"])
    ]
    for key, value in metrics["accuracy"].items():  # add_scalars: a sub-run per key
        events = read(folder / f"accuracy_{key}")
        assert [(e.step, e.value) for e in events.Scalars("accuracy")] == [(6, value)]


def test_tensorboard_missing_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # As if tensorboard were not installed: importing torch.utils.tensorboard fails.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    hint = r"`pip install tensorboard` \(or `pip install -e '\.\[tensorboard\]'` in accel's"
    with pytest.raises(ImportError, match=hint):
        TensorBoardTracker("unused")


def test_progress_shows_a_bar_on_the_main_process_only() -> None:
    stream = io.StringIO()
    items = [1, 2, 3]
    bar = progress(MAIN, items, desc="train", file=stream, mininterval=0)
    assert list(bar) == items
    assert "train: 100%" in stream.getvalue() and "3/3" in stream.getvalue()
    other = io.StringIO()
    _use_like_accelerate(progress(OTHER, items, desc="train", file=other), items)
    assert other.getvalue() == ""  # nothing drawn on other ranks


def _use_like_accelerate(bar: Any, items: Any) -> None:
    """The calls a ported loop makes on its bar, on every rank."""
    with bar as same:
        assert list(same) == list(items)
        assert len(same) == len(items)
        same.update(1)
        same.set_description("epoch 1")
        same.set_postfix(loss=0.5)
        same.set_postfix_str("loss=0.5")
        same.refresh()
        same.reset()
    bar.close()


def test_progress_gives_every_rank_a_bar_with_the_same_methods(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Accelerate's habit `bar.update(1)` must work on other ranks too, where no bar is drawn.
    items = [1, 2, 3]
    _use_like_accelerate(progress(OTHER, items), items)
    _use_like_accelerate(progress(OTHER, range(3), total=3), range(3))
    monkeypatch.setitem(sys.modules, "tqdm", None)  # and when tqdm is not installed
    _use_like_accelerate(progress(OTHER, items), items)
    with pytest.warns(UserWarning, match=r"tqdm is not installed.*`pip install tqdm`"):
        bar = progress(MAIN, items)
    _use_like_accelerate(bar, items)


def test_init_trackers_builds_by_name_and_stores_the_config(tmp_path: Path) -> None:
    config = {"lr": 0.5, "layers": 2}
    trackers = init_trackers(MAIN, ["jsonl"], project="p", config=config, directory=tmp_path)
    assert [type(t) for t in trackers] == [JSONLTracker]
    log_metrics(MAIN, {"loss": 1.0}, step=0, trackers=trackers)
    for tracker in trackers:
        tracker.close()
    assert _lines(tmp_path / "p" / "metrics.jsonl") == [
        {"hparams": config},
        {"step": 0, "loss": 1.0},
    ]


def test_init_trackers_on_other_ranks_builds_nothing(tmp_path: Path) -> None:
    registry = register_tracker("list", tracker_plugin.ListTracker)
    names = ["jsonl", "list", "tests.tracker_plugin:ListTracker"]
    trackers = init_trackers(
        OTHER, ["jsonl", "list"], project="p", config={"a": 1}, directory=tmp_path,
        registry=registry,
    )  # fmt: skip
    assert len(trackers) == 2 and all(isinstance(t, Tracker) for t in trackers)
    for tracker in trackers:
        tracker.log({"x": 1.0}, step=0)  # even called directly, a stand-in writes nothing
        tracker.log_hparams({"a": 1})
        tracker.close()
    assert list(tmp_path.iterdir()) == []
    # The same names on the main process: a user's tracker by registry and by import path.
    (first, second) = init_trackers(MAIN, names[1:], project="p", directory=tmp_path,
                                    config={"a": 1}, registry=registry)  # fmt: skip
    log_metrics(MAIN, {"x": 2}, step=4, trackers=[first, second])
    first.close()
    second.close()
    assert (tmp_path / "p" / "calls.txt").read_text().splitlines() == [
        "hparams [('a', 1)]", "hparams [('a', 1)]", "log 4 [('x', 2)]", "log 4 [('x', 2)]",
        "close", "close",
    ]  # fmt: skip


def test_register_tracker_returns_a_new_registry() -> None:
    registry = register_tracker("list", tracker_plugin.ListTracker)
    assert registry["list"] is tracker_plugin.ListTracker
    assert "list" not in BUILTIN_TRACKERS  # nothing process-wide changed
    assert list(BUILTIN_TRACKERS) == ["jsonl", "tensorboard", "wandb", "mlflow", "trackio"]
    with pytest.raises(TypeError):
        registry["other"] = tracker_plugin.ListTracker  # type: ignore[index]
    with pytest.raises(ValueError, match=r"name='wandb' is already registered"):
        register_tracker("wandb", tracker_plugin.ListTracker)
    with pytest.raises(ValueError, match=r"name='a:b' contains ':'"):
        register_tracker("a:b", tracker_plugin.ListTracker)
    with pytest.raises(TypeError, match=r"factory=3 is not callable"):
        register_tracker("three", 3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("names", "error", "match"),
    [
        (["comet_ml"], ValueError, r"tracker name 'comet_ml' is not known; expected one of"),
        (["all"], ValueError, r"tracker name 'all' is not supported"),
        (["jsonl", "jsonl"], ValueError, r"repeats a name"),
        ("jsonl", TypeError, r"names='jsonl' must be a list of tracker names"),
        (["no_such_module:X"], ValueError, r"'no_such_module:X' does not import"),
        (["tests.tracker_plugin:Missing"], ValueError, r"does not import"),
        ([" wandb"], ValueError, r"tracker name ' wandb' is not a name"),
        (None, ValueError, r"names=None and the run's config names no trackers"),
    ],
)
def test_bad_tracker_names_are_refused_on_every_rank(
    tmp_path: Path, names: Any, error: type[Exception], match: str
) -> None:
    for ctx in (MAIN, OTHER):
        with pytest.raises(error, match=match):
            init_trackers(ctx, names, project="p", directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_file_trackers_need_a_directory() -> None:
    with pytest.raises(ValueError, match=r"directory=None but 'tensorboard' writes files"):
        init_trackers(MAIN, ["tensorboard"], project="p")


def test_names_come_from_the_run_config(tmp_path: Path) -> None:
    config = load_config_text(tmp_path, "log_with: [jsonl, tensorboard]\n")
    assert config.log_with == ("jsonl", "tensorboard")
    assert parse_config({"log_with": "jsonl,tests.tracker_plugin:ListTracker"}).log_with == (
        "jsonl",
        "tests.tracker_plugin:ListTracker",
    )
    with pytest.raises(ValueError, match=r"log_with: tracker name 'all' is not supported"):
        parse_config({"log_with": "all"})
    ctx = dataclasses.replace(MAIN, log_with=config.log_with)
    trackers = init_trackers(ctx, None, project="p", directory=tmp_path)
    assert [type(t) for t in trackers] == [JSONLTracker, TensorBoardTracker]
    for tracker in trackers:
        tracker.close()
    assert env_settings({"ACCEL_LOG_WITH": "wandb,mlflow"})["log_with"] == (
        ("wandb", "mlflow"),
        "env ACCEL_LOG_WITH",
    )


def load_config_text(folder: Path, text: str) -> Config:
    path = folder / "c.yaml"
    path.write_text(text)
    return load_config(path)


@pytest.mark.parametrize(
    ("name", "package", "module"),
    [("wandb", "wandb", "wandb"), ("mlflow", "mlflow", "mlflow.tracking"),
     ("trackio", "trackio", "trackio")],
)  # fmt: skip
def test_missing_service_packages_name_the_extra(
    monkeypatch: pytest.MonkeyPatch, name: str, package: str, module: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # as if the package were not installed
    hint = rf"`pip install {package}` \(or `pip install -e '\.\[{package}\]'` in accel's"
    with pytest.raises(ImportError, match=hint):
        init_trackers(MAIN, [name], project="p")
    # Other ranks never import it.
    assert len(init_trackers(OTHER, [name], project="p")) == 1
