"""save_state inside an accumulation window keeps the gradients accumulated so far.

A run saved after a micro-step that did not sync, then resumed into fresh objects in new
processes, must end with the weights of the uninterrupted run, bit for bit: at one process and
under DDP, where each rank's accumulated gradients are its own (not reduced yet).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accel
from accel.testing import run_world

MICRO_STEPS = 6


def _setup(ctx: accel.RunContext, init_seed: int) -> tuple[nn.Module, torch.optim.Optimizer, accel.RunContext]:
    ctx = dataclasses.replace(ctx, grad_accum_steps=3)
    torch.manual_seed(init_seed)  # a resumed run starts from other weights: load_state must fix them
    model = accel.wrap_model(ctx, nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), ctx


def _micro_step(ctx: accel.RunContext, model: nn.Module, opt: torch.optim.Optimizer, k: int) -> None:
    g = torch.Generator().manual_seed(100 * k + ctx.rank)  # each rank its own data
    x, y = torch.randn(5, 4, generator=g), torch.randn(5, 1, generator=g)
    with accel.accumulate(ctx, model, k) as sync:
        accel.scaled_backward(ctx, F.mse_loss(model(x), y))
    if sync:
        opt.step()
        opt.zero_grad(set_to_none=True)


def _weights(model: nn.Module) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in accel.unwrap_model(model).parameters()]


def _train(ctx: accel.RunContext, folder: str, save_after: int | None) -> dict[str, Any]:
    model, opt, ctx = _setup(ctx, init_seed=0)
    out: dict[str, Any] = {}
    for k in range(MICRO_STEPS):
        _micro_step(ctx, model, opt, k)
        if k == save_after:
            accel.save_state(ctx, Path(folder, f"after{k}"), model=model, optimizer=opt)
            manifest = json.loads(Path(folder, f"after{k}", "accel-manifest.json").read_text())
            out[f"files{k}"] = sorted(manifest["files"])
            save_after = 2 if k == 1 else None  # also right after the sync at 2: no gradients
    out["weights"] = _weights(model)
    return out


def _resume(ctx: accel.RunContext, folder: str, saved_after: int) -> list[list[float]]:
    model, opt, ctx = _setup(ctx, init_seed=1)
    _micro_step(ctx, model, opt, 0)  # stale gradients in the fresh model must not survive
    accel.load_state(ctx, Path(folder, f"after{saved_after}"), model=model, optimizer=opt)
    for k in range(saved_after + 1, MICRO_STEPS):
        _micro_step(ctx, model, opt, k)
    return _weights(model)


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.dist)])
def test_resume_inside_an_accumulation_window_matches_the_uninterrupted_run(
    world_size: int, tmp_path: Path
) -> None:
    folder = str(tmp_path)
    straight = run_world(_train, world_size=world_size, timeout=120, args=(folder, None))
    saved = run_world(_train, world_size=world_size, timeout=120, args=(folder, 1))
    assert [r["weights"] for r in saved] == [r["weights"] for r in straight]
    for after in (1, 2):
        resumed = run_world(_resume, world_size=world_size, timeout=120, args=(folder, after))
        assert resumed == [r["weights"] for r in straight], f"resumed after micro-step {after}"
    # after micro-step 1 (no sync yet) every rank's accumulated gradients are in the checkpoint;
    # after micro-step 2 (synced, zero_grad(set_to_none=True)) there are none to write
    files1, files2 = saved[0]["files1"], saved[0]["files2"]
    for r in range(world_size):
        assert any("grad" in f and f"rank{r}" in f for f in files1), files1
    assert not any("grad" in f for f in files2), files2
    if world_size > 1:  # partial per-rank sums cannot move to another world size
        model, opt, ctx = _setup(accel.RunContext.single(), init_seed=1)
        with pytest.raises(ValueError, match="accumulated on world_size=2 ranks .* world_size=1"):
            accel.load_state(ctx, Path(folder, "after1"), model=model, optimizer=opt)


def _fsdp_inside_window(ctx: accel.RunContext, folder: str) -> list[str]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = fully_shard(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    model(torch.randn(3, 4)).sum().backward()
    errors = []
    try:
        accel.save_state(ctx, Path(folder, "fsdp"), model=model)
    except NotImplementedError as err:
        errors.append(str(err))
    model.zero_grad(set_to_none=True)
    accel.save_state(ctx, Path(folder, "fsdp"), model=model)  # outside a window: saved
    return errors


@pytest.mark.dist
def test_sharded_gradients_inside_a_window_are_refused_by_name(tmp_path: Path) -> None:
    errors = run_world(_fsdp_inside_window, world_size=2, timeout=120, args=(str(tmp_path),))
    for err in errors:
        assert err and "model= is sharded by FSDP2 and holds gradients accumulated" in err[0]
    assert (tmp_path / "fsdp" / "accel-manifest.json").is_file()
    assert not any("grad" in p.name for p in (tmp_path / "fsdp").rglob("*"))
