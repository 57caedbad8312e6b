"""W&B, MLflow and trackio for real, in their local modes, at 2 ranks: one run per service, every
metric once with its step, the config as hyper-parameters, and nothing from rank 1.

Each run is read back through the service's own reader: wandb's `.wandb` record file, MLflow's
`MlflowClient` over the SQLite store, trackio's SQLite project file.
"""

from __future__ import annotations

import json
import os
import sqlite3
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

from accel import RunContext, init_trackers, log_metrics
from accel.testing import run_world

CONFIG = {"lr": 0.1, "layers": 2, "optimizer": "adamw"}
STEPS = 3


def _loss(step: int) -> float:
    return 1.0 / (step + 1)


def _train(ctx: RunContext, name: str, directory: str | None) -> str:
    trackers = init_trackers(ctx, [name], project="accel-test", config=CONFIG, directory=directory)
    for step in range(STEPS):
        # "rank" tells which process wrote a row: only 0 may appear.
        metrics = {"loss": _loss(step), "rank": ctx.rank}
        log_metrics(ctx, metrics, step=step, trackers=trackers)
    for tracker in trackers:
        tracker.close()
    return type(trackers[0]).__name__


def _run(name: str, directory: Path | None) -> None:
    kinds = run_world(
        _train,
        world_size=2,
        timeout=240,
        args=(name, None if directory is None else str(directory)),
    )
    assert kinds[1] == "_OffMainTracker" and kinds[0] != kinds[1]


def _expected() -> list[tuple[int, dict[str, float]]]:
    return [(step, {"loss": _loss(step), "rank": 0}) for step in range(STEPS)]


# wandb's `.wandb` file is a LevelDB-style log (wandb-core writes it; wandb 0.31 has no Python
# reader): a 7-byte file header, then 32 KiB blocks of chunks, each with a 7-byte header
# (crc32 of type + data, length, type: 1 full, 2 first, 3 middle, 4 last) holding a serialized
# `wandb_internal_pb2.Record`.
_BLOCK, _HEADER = 32768, 7


def _wandb_records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:_HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0)
    records, pending, offset = [], b"", _HEADER
    while offset + _HEADER <= len(data):
        if _BLOCK - offset % _BLOCK < _HEADER:  # a block's tail too short for a header is padding
            offset += _BLOCK - offset % _BLOCK
            continue
        checksum, length, kind = struct.unpack("<IHB", data[offset : offset + _HEADER])
        chunk = data[offset + _HEADER : offset + _HEADER + length]
        offset += _HEADER + length
        if kind == 0 and length == 0:
            break  # zeros: the end of what was written
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == checksum
        pending += chunk
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)  # wandb-core writes history keys nested


@pytest.mark.dist
@pytest.mark.slow
def test_wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The spawned ranks inherit these: an offline run in tmp_path, nothing on the network.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    _run("wandb", tmp_path)
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")  # one run
    records = _wandb_records(run_file)
    history = []
    config: dict[str, Any] = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {_key(item): json.loads(item.value_json) for item in record.history.item}
            history.append(
                (row.pop("_step"), {k: v for k, v in row.items() if k in ("loss", "rank")})
            )
        elif kind in ("run", "config"):
            items = record.run.config.update if kind == "run" else record.config.update
            config |= {item.key: json.loads(item.value_json) for item in items}
    assert history == _expected()
    assert {k: config[k] for k in CONFIG} == CONFIG
    assert next(r.run.project for r in records if r.WhichOneof("record_type") == "run") == (
        "accel-test"
    )


@pytest.mark.dist
@pytest.mark.slow
def test_mlflow_local_store(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    _run("mlflow", tmp_path)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("accel-test")
    (run,) = client.search_runs([experiment.experiment_id])  # one run
    assert run.info.status == "FINISHED"
    assert run.data.params == {k: str(v) for k, v in CONFIG.items()}
    rows: dict[int, dict[str, float]] = {}
    for key in ("loss", "rank"):
        for metric in client.get_metric_history(run.info.run_id, key):
            assert key not in rows.setdefault(metric.step, {})  # every metric once
            rows[metric.step][key] = metric.value
    assert sorted(rows.items()) == _expected()


@pytest.mark.dist
@pytest.mark.slow
def test_trackio_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path))  # trackio's own setting for where it stores
    _run("trackio", None)
    with sqlite3.connect(tmp_path / "accel-test.db") as db:
        runs = db.execute("SELECT DISTINCT run_name FROM metrics").fetchall()
        rows = db.execute("SELECT step, metrics FROM metrics ORDER BY step").fetchall()
        configs = db.execute("SELECT config FROM configs").fetchall()
    assert len(runs) == 1  # one run
    logged = [
        (step, {k: v for k, v in json.loads(m).items() if k in ("loss", "rank")})
        for step, m in rows
    ]
    assert logged == _expected()
    assert len(configs) == 1 and {k: json.loads(configs[0][0])[k] for k in CONFIG} == CONFIG


@pytest.mark.slow
def test_mlflow_takes_a_dict_as_metrics_and_warns_for_a_string(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from accel import MLflowTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ctx = RunContext.single()
    with MLflowTracker("accel-test", tracking_uri=uri) as tracker:
        metrics = {"accuracy": {"accuracy": 0.75, "f1": 0.5}, "note": "ok", "step": 6}
        with pytest.warns(UserWarning, match=r"metrics\['note'\]='ok' is a string"):
            log_metrics(ctx, metrics, step=6, trackers=[tracker])
        run_id = tracker.run_id
    client = MlflowClient(tracking_uri=uri)
    history = {
        key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
        for key in client.get_run(run_id).data.metrics
    }
    assert history == {
        "accuracy/accuracy": [(6, 0.75)],
        "accuracy/f1": [(6, 0.5)],
        "step": [(6, 6.0)],
    }


@pytest.mark.slow
def test_a_new_mlflow_store_is_made_without_mlflows_info_lines(tmp_path: Path) -> None:
    """Issue 44 item 7: every run with a fresh local store printed MLflow's two INFO lines
    about creating its database tables."""
    code = (
        "import sys, accel\n"
        "with accel.MLflowTracker('p', tracking_uri=sys.argv[1]) as tracker:\n"
        "    accel.log_metrics(accel.RunContext.single(), {'loss': 1.0}, step=0,"
        " trackers=[tracker])\n"
        "print(tracker.run_id is not None)\n"
    )
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run(
        [sys.executable, "-c", code, uri], capture_output=True, text=True, env=env, timeout=180
    )
    assert (out.returncode, out.stdout) == (0, "True\n"), out.stderr
    assert "INFO" not in out.stderr, out.stderr
