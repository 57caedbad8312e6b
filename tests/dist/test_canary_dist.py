"""run_world inside device_canary(): every rank runs under the canary, on the canary's device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import accel
from accel.testing import device_canary, run_world


def _step(ctx: accel.RunContext, move: bool, strategy: str = "auto") -> tuple[str, float]:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    model = accel.wrap_model(ctx, model, strategy=strategy)  # auto: DDP at two ranks
    x = torch.ones(2, 4)  # made on the host
    loss = model(x.to(ctx.device) if move else x).sum()
    accel.scaled_backward(ctx, loss)
    return str(ctx.device), float(accel.reduce(ctx, loss.detach(), op="mean"))


@pytest.mark.parametrize("strategy", ["auto", "fsdp2"])
def test_ranks_run_under_the_canary_and_fail_a_host_batch(strategy: str) -> None:
    # FSDP2 names the mesh's device type ("cpu") for its shards and all-gather buffers; the
    # canary reads torch.distributed's "cpu" as the run's device, so only the batch is wrong.
    with device_canary():
        seen = run_world(_step, world_size=2, args=(True, strategy), timeout=120)
        assert [device for device, _ in seen] == ["cpu:0", "cpu:0"]
        with pytest.raises(RuntimeError, match=r"device canary: torch\.nn\.functional\.linear"):
            run_world(_step, world_size=2, args=(False, strategy), timeout=120)
    if strategy == "fsdp2":
        return
    # outside the canary the same unmoved batch runs, as it does on any CPU
    assert [device for device, _ in run_world(_step, world_size=2, args=(False,))] == ["cpu"] * 2
