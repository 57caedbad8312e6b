"""run_world inside device_canary(): every rank runs under the canary, on the canary's device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import accel
from accel.testing import device_canary, run_world


def _step(ctx: accel.RunContext, move: bool) -> tuple[str, float]:
    model = accel.wrap_model(ctx, nn.Linear(4, 1))  # DDP at two ranks
    x = torch.ones(2, 4)  # made on the host
    loss = model(x.to(ctx.device) if move else x).sum()
    accel.scaled_backward(ctx, loss)
    return str(ctx.device), float(accel.reduce(ctx, loss.detach(), op="mean"))


def test_ranks_run_under_the_canary_and_fail_a_host_batch() -> None:
    with device_canary():
        seen = run_world(_step, world_size=2, args=(True,), timeout=120)
        assert [device for device, _ in seen] == ["cpu:0", "cpu:0"]
        with pytest.raises(RuntimeError, match="device canary: torch.nn.functional.linear"):
            run_world(_step, world_size=2, args=(False,), timeout=120)
    # outside the canary the same unmoved batch runs, as it does on any CPU
    assert [device for device, _ in run_world(_step, world_size=2, args=(False,))] == ["cpu"] * 2
