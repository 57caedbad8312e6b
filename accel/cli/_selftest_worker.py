"""The checks `accel test` runs on every process (as `python -m accel.cli._selftest_worker`)."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

import torch

import accel


def check_collectives(ctx: accel.RunContext) -> None:
    n = ctx.world_size
    mine = torch.tensor([2.0 * ctx.rank + 1, 2.0 * ctx.rank + 2])
    got = accel.gather(ctx, mine).tolist()
    assert got == [float(i) for i in range(1, 2 * n + 1)], f"gather gave {got}"
    assert accel.reduce(ctx, mine, op="max").tolist() == [2.0 * n - 1, 2.0 * n], "reduce max"


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def check_ddp_step(ctx: accel.RunContext) -> torch.nn.Module:
    # One fp32 step without accumulation, whatever the configuration says, to compare exactly.
    ctx = dataclasses.replace(ctx, grad_accum_steps=1, precision="fp32")
    torch.manual_seed(0)
    reference = torch.nn.Linear(4, 1)
    model = torch.nn.Linear(4, 1)
    model.load_state_dict(reference.state_dict())
    wrapped = accel.wrap_model(ctx, model)  # DDP when there are several processes
    x, y = _data(ctx.rank)
    with accel.accumulate(ctx, wrapped, 0, is_last=True):
        accel.scaled_backward(ctx, torch.nn.functional.mse_loss(wrapped(x), y))
    accel.optimizer_step(ctx, torch.optim.SGD(wrapped.parameters(), lr=0.1))
    # The same step on the full batch of every rank, computed here without communication.
    xs, ys = zip(*(_data(r) for r in range(ctx.world_size)), strict=True)
    loss = torch.nn.functional.mse_loss(reference(torch.cat(xs)), torch.cat(ys))
    loss.backward()  # type: ignore[no-untyped-call]
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), "DDP step differs from the full-batch step"
    return model


def check_checkpoint(ctx: accel.RunContext, model: torch.nn.Module) -> None:
    """save_state then load_state into a fresh model: every tensor comes back equal."""
    folder = accel.broadcast_object(
        ctx, tempfile.mkdtemp(prefix="accel-test-") if ctx.is_main else ""
    )
    path = Path(folder) / "state"
    accel.save_state(ctx, path, model=model)
    fresh = torch.nn.Linear(4, 1)
    accel.load_state(ctx, path, model=fresh)
    for (name, value), restored in zip(
        model.state_dict().items(), fresh.state_dict().values(), strict=True
    ):
        assert torch.equal(restored, value), f"checkpoint round trip changed {name}"
    accel.wait_for_everyone(ctx)
    if ctx.is_main:
        shutil.rmtree(folder)


def main() -> None:
    ctx = accel.init_distributed()
    check_collectives(ctx)
    model = check_ddp_step(ctx)
    check_checkpoint(ctx, model)
    print(f"accel test: rank {ctx.rank} of {ctx.world_size} ok ({ctx.backend}, {ctx.device})")
    accel.shutdown(ctx)


if __name__ == "__main__":
    main()
