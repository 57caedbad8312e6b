"""accel.profile writes torch.profiler's Chrome traces, one per rank, holding the step's ops."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from accel import RunContext, profile, reduce, wrap_model
from accel.testing import run_world


def _names(trace: Path) -> set[str]:
    return {event["name"] for event in json.loads(trace.read_text())["traceEvents"]}


def _train(ctx: RunContext, output_dir: str, num_steps: int = 3) -> dict[str, Any]:
    torch.manual_seed(0)
    model = wrap_model(ctx, nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with profile(ctx, output_dir=output_dir, record_shapes=True) as prof:
        for _ in range(num_steps):
            loss = model(torch.randn(16, 8)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    summary = {row.key for row in prof.key_averages()}
    return {"has_linear": "aten::linear" in summary, "loss": reduce(ctx, loss.detach()).item()}


@pytest.mark.dist
def test_two_ranks_write_two_traces_holding_the_step(tmp_path: Path) -> None:
    results = run_world(_train, world_size=2, timeout=120, args=(str(tmp_path / "traces"),))
    assert all(r["has_linear"] for r in results)
    traces = sorted((tmp_path / "traces").iterdir())
    assert [t.name for t in traces] == ["profile_0.json", "profile_1.json"]
    for trace in traces:
        names = _names(trace)
        # forward, backward, DDP's gradient all-reduce and the optimizer step of this rank
        assert {"aten::linear", "aten::mm", "Optimizer.step#SGD.step"} <= names, trace
        assert any("allreduce" in n for n in names), trace
        events = json.loads(trace.read_text())["traceEvents"]
        shapes = [e["args"]["Input Dims"] for e in events if e["name"] == "aten::addmm"]
        # record_shapes=True reached the profiler: addmm(bias, x, weight.T) of every step
        assert shapes == [[[4], [16, 8], [8, 4], [], []]] * 3


def test_a_schedule_writes_one_trace_per_active_cycle(tmp_path: Path) -> None:
    ctx = RunContext()
    schedule = {"wait": 1, "warmup": 1, "active": 2, "repeat": 2}
    # torch warns, once a second cycle starts, that key_averages() covers the last cycle only
    clears = pytest.warns(UserWarning, match="Profiler clears events at the end of each cycle")
    with clears, profile(ctx, output_dir=tmp_path, schedule=schedule) as prof:
        for step in range(10):
            torch.ones(3).mul(step)
            prof.step()
    # cycles of 4 steps (wait, warmup, 2 active) end at steps 4 and 8; then the profiler idles
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "profile_0_step4.json",
        "profile_0_step8.json",
    ]
    assert all("aten::mul" in _names(p) for p in tmp_path.iterdir())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"activities": ["tpu"]}, ValueError, r"profile: activities contains 'tpu'"),
        ({"schedule": {"wait": 1, "steps": 2}}, ValueError, r"profile: schedule=.* is not a"),
        ({"output_dir": 3}, TypeError, r"profile: output_dir=3 must be a path"),
    ],
)
def test_bad_options_are_refused_by_name(
    tmp_path: Path, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    options = {"output_dir": tmp_path, **kwargs}
    with pytest.raises(error, match=match), profile(RunContext(), **options):
        pass
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
def test_cuda_activity_without_cuda_is_refused(tmp_path: Path) -> None:
    refused = r"activities contains 'cuda' but CUDA is not available"
    with (
        pytest.raises(ValueError, match=refused),
        profile(RunContext(), output_dir=tmp_path, activities=["cuda"]),
    ):
        pass
