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
from torch.distributed.tensor import DTensor

import accel
from accel import Parallelism
from accel.testing import run_world

MICRO_STEPS = 6


TP_PLAN = {"0": "colwise", "2": "rowwise"}


def _setup(
    ctx: accel.RunContext, init_seed: int
) -> tuple[nn.Module, torch.optim.Optimizer, accel.RunContext]:
    ctx = dataclasses.replace(ctx, grad_accum_steps=3)
    torch.manual_seed(
        init_seed
    )  # a resumed run starts from other weights: load_state must fix them
    tp = ctx.parallelism is not None and ctx.parallelism.tp > 1
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model = accel.wrap_model(ctx, model, tp_plan=TP_PLAN if tp else None)  # DDP, FSDP2 or both
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), ctx


def _micro_step(
    ctx: accel.RunContext, model: nn.Module, opt: torch.optim.Optimizer, k: int
) -> None:
    g = torch.Generator().manual_seed(100 * k + ctx.dp_rank)  # each data-parallel rank its own
    x, y = torch.randn(5, 4, generator=g), torch.randn(5, 1, generator=g)
    with accel.accumulate(ctx, model, k) as sync:
        accel.scaled_backward(ctx, F.mse_loss(model(x), y))
    if sync:
        opt.step()
        opt.zero_grad(set_to_none=True)


def _weights(model: nn.Module) -> list[list[float]]:
    params = [p.detach() for p in accel.unwrap_model(model).parameters()]
    return [(p.full_tensor() if isinstance(p, DTensor) else p).flatten().tolist() for p in params]


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


def _train_twice(ctx: accel.RunContext, folder: str) -> dict[str, Any]:
    """The run uninterrupted, then again saving after micro-steps 1 and 2 (fresh objects)."""
    return {"straight": _train(ctx, folder, None), "saved": _train(ctx, folder, 1)}


def _resume(ctx: accel.RunContext, folder: str, saved_after: int) -> list[list[float]]:
    model, opt, ctx = _setup(ctx, init_seed=1)
    _micro_step(ctx, model, opt, 0)  # stale gradients in the fresh model must not survive
    accel.load_state(ctx, Path(folder, f"after{saved_after}"), model=model, optimizer=opt)
    for k in range(saved_after + 1, MICRO_STEPS):
        _micro_step(ctx, model, opt, k)
    return _weights(model)


def _resume_each(ctx: accel.RunContext, folder: str) -> dict[int, list[list[float]]]:
    """Resume from each checkpoint in turn, each into fresh objects."""
    return {after: _resume(ctx, folder, after) for after in (1, 2)}


WORLDS = {
    "1 process": (1, None),
    "ddp-2": (2, None),
    "fsdp2-2": (2, Parallelism(dp_shard=2)),  # the sums sit on FSDP2's unsharded parameters
    "fsdp2xtp-4": (4, Parallelism(dp_shard=2, tp=2)),  # ... which are tensor-parallel DTensors
}


@pytest.mark.parametrize(
    "world",
    [pytest.param(w, marks=[pytest.mark.dist] if WORLDS[w][0] > 1 else []) for w in WORLDS],
)
def test_resume_inside_an_accumulation_window_matches_the_uninterrupted_run(
    world: str, tmp_path: Path
) -> None:
    world_size, parallelism = WORLDS[world]
    folder = str(tmp_path)

    def run(fn: Any, *args: Any) -> Any:
        return run_world(fn, world_size=world_size, timeout=120, args=(folder, *args),
                         parallelism=parallelism)  # fmt: skip

    # Two worlds, not four: the runs with and without saving share one, the resumes (in new
    # processes, as a restarted job) the other.
    trained = run(_train_twice)
    straight = [r["straight"]["weights"] for r in trained]
    assert [r["saved"]["weights"] for r in trained] == straight
    resumed = run(_resume_each)
    for after in (1, 2):
        assert [r[after] for r in resumed] == straight, f"resumed after {after}"
    # after micro-step 1 (no sync yet) every rank's accumulated gradients are in the checkpoint;
    # after micro-step 2 (synced, zero_grad(set_to_none=True)) there are none to write
    files1, files2 = trained[0]["saved"]["files1"], trained[0]["saved"]["files2"]
    for r in range(world_size):
        assert any("grad" in f and f"rank{r}" in f for f in files1), files1
    assert not any("grad" in f for f in files2), files2
    if world_size > 1 and parallelism is None:  # per-rank sums cannot move to another size
        model, opt, ctx = _setup(accel.RunContext.single(), init_seed=1)
        with pytest.raises(ValueError, match=r"accumulated on world_size=2 ranks .* world_size=1"):
            accel.load_state(ctx, Path(folder, "after1"), model=model, optimizer=opt)


def _fsdp_at_another_mesh(ctx: accel.RunContext, folder: str) -> str:
    model, opt, ctx = _setup(ctx, init_seed=1)
    try:
        accel.load_state(ctx, Path(folder, "after1"), model=model, optimizer=opt)
    except ValueError as err:
        return str(err)
    return ""


@pytest.mark.dist
def test_sharded_window_gradients_load_only_at_their_mesh(tmp_path: Path) -> None:
    run_world(_train, world_size=2, timeout=120, args=(str(tmp_path), 1),
              parallelism=Parallelism(dp_shard=2))  # fmt: skip
    errors = run_world(_fsdp_at_another_mesh, world_size=4, timeout=120,
                       args=(str(tmp_path),), parallelism=Parallelism(dp_shard=4))  # fmt: skip
    assert all("accumulated on world_size=2 ranks" in e for e in errors), errors
