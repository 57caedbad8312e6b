"""A user's own pytest for their training step, at world sizes 1 and 2, on a laptop CPU.

    pytest examples/test_my_step.py
    accel launch --num_processes 2 examples/test_my_step.py   # also runs as a script

`accel.testing.run_world` starts real processes over gloo, calls the function with a RunContext
for each rank and returns what each rank returned; a failing rank's traceback is raised here.
`accel.testing.device_canary()` makes a tensor left on the host fail as it would on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accel
from accel.testing import device_canary, run_world


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def train_step(ctx: accel.RunContext, model: nn.Module, opt: torch.optim.Optimizer, x, y) -> float:  # type: ignore[no-untyped-def]
    """The step under test: this rank's share of the global batch, gradients averaged by DDP."""
    per_rank = len(x) // ctx.world_size
    xb, yb = (
        x[ctx.rank * per_rank : (ctx.rank + 1) * per_rank].to(ctx.device),
        y[ctx.rank * per_rank : (ctx.rank + 1) * per_rank].to(ctx.device),
    )
    with accel.accumulate(ctx, model, 0) as sync:
        loss = F.mse_loss(model(xb), yb)
        accel.scaled_backward(ctx, loss)
    assert sync
    accel.optimizer_step(ctx, opt)
    opt.zero_grad()
    return float(accel.reduce(ctx, loss.detach(), op="mean"))


def _run(ctx: accel.RunContext) -> list[torch.Tensor]:
    model = accel.wrap_model(ctx, make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        train_step(ctx, model, opt, torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))
    return [p.detach().cpu() for p in accel.unwrap_model(model).parameters()]


@pytest.mark.parametrize("world_size", [1, 2])
def test_step_matches_single_process_full_batch(world_size: int) -> None:
    # Under the device canary ctx.device is a device of its own (CPU memory, real values): a
    # tensor the step forgets to move to ctx.device fails here as it would on a GPU.
    with device_canary():
        reference = _run(accel.RunContext.single())  # in this process, no process group
        for params in run_world(_run, world_size=world_size, timeout=120):
            for got, want in zip(params, reference, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


if __name__ == "__main__":
    ctx = accel.init_distributed()
    print(
        f"[rank {ctx.rank}] parameters after 3 steps: {sum(p.sum().item() for p in _run(ctx)):.6f}"
    )
    accel.shutdown(ctx)
