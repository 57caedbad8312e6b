"""Trackers and progress in a real 2-process world: every rank calls, only rank 0 writes."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from accel import (
    JSONLTracker,
    RunContext,
    TensorBoardTracker,
    log_hparams,
    log_metrics,
    progress,
    reduce,
)
from accel.testing import run_world


def _log_from_every_rank(ctx: RunContext, folder: str) -> tuple[bool, str]:
    out = Path(folder)
    trackers = [JSONLTracker(out / "metrics.jsonl"), TensorBoardTracker(out / "tb")]
    log_hparams(ctx, {"lr": 0.1, "world_size": ctx.world_size}, trackers=trackers)
    stream = io.StringIO()
    steps = range(2)
    bar = progress(ctx, steps, desc="steps", file=stream, mininterval=0)
    for step in bar:
        # Each rank passes its own value; the reduced mean is what a user would log.
        loss = reduce(ctx, torch.tensor(float(ctx.rank + step)), op="mean")
        log_metrics(ctx, {"loss": loss, "rank": ctx.rank}, step=step, trackers=trackers)
    bar.set_postfix(loss=0.5)  # the Accelerate habit works on every rank
    bar.close()
    for tracker in trackers:
        tracker.close()
    return bar is steps, stream.getvalue()


@pytest.mark.dist
def test_only_rank_0_writes(tmp_path: Path) -> None:
    results = run_world(_log_from_every_rank, world_size=2, timeout=120, args=(str(tmp_path),))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [
        {"hparams": {"lr": 0.1, "world_size": 2}},
        {"step": 0, "loss": 0.5, "rank": 0},
        {"step": 1, "loss": 1.5, "rank": 0},
    ]
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1
    (main_is_plain, main_bar), (other_is_plain, other_bar) = results
    assert not main_is_plain and "steps: 100%" in main_bar and "2/2" in main_bar
    assert not other_is_plain and other_bar == ""  # a bar with tqdm's methods that draws nothing
