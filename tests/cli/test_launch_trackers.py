"""Tracker names from the launcher: `accel launch --log_with` and the config's `log_with` reach
`init_trackers(ctx, None, ...)` in every worker; only rank 0 writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from accel.cli import _launch
from accel.config import as_mapping, parse_config
from tests.cli.test_cli import accel_cli

TRACKED_SCRIPT = """
import sys
import accel
ctx = accel.init_distributed()
trackers = accel.init_trackers(ctx, None, project="p", config={"lr": 0.5}, directory=sys.argv[1])
accel.log_metrics(ctx, {"rank": ctx.rank}, step=ctx.rank, trackers=trackers)
for tracker in trackers:
    tracker.close()
with open(f"{sys.argv[1]}/{ctx.rank}.names", "w") as f:
    f.write(",".join(ctx.log_with) + " " + ctx.sources["log_with"])
accel.shutdown(ctx)
"""


def test_log_with_travels_to_the_workers() -> None:
    config = parse_config({"log_with": ["jsonl", "tests.tracker_plugin:ListTracker"]})
    env = _launch.worker_environment(config)
    assert env["ACCEL_LOG_WITH"] == "jsonl,tests.tracker_plugin:ListTracker"
    assert as_mapping(config)["log_with"] == ["jsonl", "tests.tracker_plugin:ListTracker"]
    assert "ACCEL_LOG_WITH" not in _launch.worker_environment(parse_config({}))


@pytest.mark.slow
def test_launch_log_with_builds_the_trackers(tmp_path: Path) -> None:
    script = tmp_path / "tracked.py"
    script.write_text(TRACKED_SCRIPT)
    names = "jsonl,tests.tracker_plugin:ListTracker"
    out = accel_cli(
        tmp_path, "launch", "--num_processes", "2", "--log_with", names, str(script), str(tmp_path)
    )
    assert out.returncode == 0, out.stderr
    for rank in range(2):
        names = (tmp_path / f"{rank}.names").read_text()
        assert names == "jsonl,tests.tracker_plugin:ListTracker env ACCEL_LOG_WITH"
    lines = [json.loads(x) for x in (tmp_path / "p" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"hparams": {"lr": 0.5}}, {"step": 0, "rank": 0}]
    calls = (tmp_path / "p" / "calls.txt").read_text().splitlines()
    assert calls == ["hparams [('lr', 0.5)]", "log 0 [('rank', 0)]", "close"]


def test_launch_refuses_all_by_name(tmp_path: Path) -> None:
    out = accel_cli(tmp_path, "launch", "--log_with", "all", "unused.py")
    assert out.returncode != 0
    assert "log_with: tracker name 'all' is not supported" in out.stderr
