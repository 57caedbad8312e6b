"""run_world inside device_canary(): every rank runs under the canary, on the canary's device."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

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


def _collective(ctx: accel.RunContext, on_host: bool) -> float:
    t = torch.ones(3) if on_host else torch.ones(3, device=ctx.device)
    torch.distributed.all_reduce(t)  # torch's own call, as a user's script makes it
    return float(t.sum())


def test_a_collective_given_a_host_tensor_fails_as_nccl_fails() -> None:
    # On a GPU the ranks' group is NCCL's, which takes tensors on the GPU only; gloo (the
    # canary's group underneath) takes either, so the canary checks what NCCL would refuse.
    with device_canary():
        assert run_world(_collective, world_size=2, args=(False,), timeout=120) == [6.0, 6.0]
        with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
            run_world(_collective, world_size=2, args=(True,), timeout=120)
    assert run_world(_collective, world_size=2, args=(True,)) == [6.0, 6.0]  # gloo on a CPU


class _Rows(torch.utils.data.IterableDataset[torch.Tensor]):
    """A stream of rows that splits itself (every rank reads its own part, aligned each step)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def shard(self, num_shards: int, index: int) -> _Rows:
        return _Rows(self.rows[index::num_shards])

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.rows)


def _accel_on_nccl(ctx: accel.RunContext) -> dict[str, Any]:
    """accel's own collectives, as a multi-GPU run makes them: each must hand NCCL tensors on
    the run's device, whatever the caller passed."""
    stream = accel.shard_loader(
        ctx, DataLoader(_Rows(torch.arange(10.0).reshape(5, 2)), batch_size=2)
    )
    seen = [accel.gather_for_metrics(ctx, batch, loader=stream) for batch in stream]
    big = torch.full((5000,), float(ctx.rank + 1))  # past what rides along with the check
    reduced, gathered = accel.reduce(ctx, big, op="sum"), accel.gather(ctx, big)
    sent = accel.broadcast(ctx, big, src=1)
    return {
        "stream": torch.cat(seen).tolist(),
        "reduced": (str(reduced.device), float(reduced[0])),
        "gathered": (str(gathered.device), gathered[::5000].tolist()),
        "sent": (str(sent.device), float(sent[0])),
    }


def test_accels_collectives_hand_nccl_tensors_on_the_device() -> None:
    with device_canary():
        results = run_world(_accel_on_nccl, world_size=2, timeout=120)
    for got in results:
        assert sorted(got["stream"]) == torch.arange(10.0).reshape(5, 2).tolist()
        # a host tensor in, a host tensor out: NCCL's copy on the device is accel's business
        assert got["reduced"] == ("cpu", 3.0)
        assert got["gathered"] == ("cpu", [1.0, 2.0])
        assert got["sent"] == ("cpu", 2.0)
