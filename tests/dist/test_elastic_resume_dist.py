"""Resume a run on another world size: same optimizer steps, same samples, same losses.

The reference is the uninterrupted run at 4 ranks; the resumed runs use 2 ranks and 1 process
with gradient accumulation keeping the global batch (2 per rank x 4 ranks x 1 = 2 x 2 x 2 =
2 x 1 x 4 = 8 samples per optimizer step).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel
from accel import RunContext
from accel.testing import run_world

N = 64  # samples: 8 optimizer steps per epoch at a global batch of 8
EPOCHS = 2
TIMEOUT = 120


class Steps:
    """Optimizer steps taken so far (training state the loop owns)."""

    def __init__(self) -> None:
        self.done = 0

    def state_dict(self) -> dict[str, Any]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.done = int(state["done"])


def _loader(ctx: RunContext) -> accel.ShardedLoader:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g))
    return accel.shard_loader(ctx, DataLoader(data, batch_size=2, shuffle=True), seed=5)


def train(ctx: RunContext, root: str, accum: int, stop_at: int | None, resume: bool) -> Any:
    """Per-optimizer-step global losses (on every rank) and the final parameters."""
    ctx = dataclasses.replace(ctx, grad_accum_steps=accum)
    torch.manual_seed(0)
    model = accel.wrap_model(ctx, nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    loader, steps = _loader(ctx), Steps()
    if resume:
        accel.load_state(ctx, root, model=model, optimizer=opt, loader=loader, steps=steps)
    losses = []
    while loader.epoch < EPOCHS:
        window, k = torch.zeros(()), 0  # the loss summed over this window, micro-steps in it
        for batch_x, batch_y in loader:
            with accel.accumulate(ctx, model, steps.done * accum + k) as sync:
                loss = F.mse_loss(model(batch_x), batch_y) / accum
                loss.backward()
            window, k = window + loss.detach(), k + 1
            if sync:
                opt.step()
                opt.zero_grad(set_to_none=True)
                steps.done += 1
                losses.append(accel.reduce(ctx, window, op="mean").item())
                window, k = torch.zeros(()), 0
                if steps.done == stop_at:  # the "crash", mid-epoch: save and stop
                    accel.save_state(ctx, root, model=model, optimizer=opt, loader=loader,
                                     steps=steps)  # fmt: skip
                    return {"losses": losses}
    params = [p.detach().clone() for p in accel.unwrap_model(model).parameters()]
    return {"losses": losses, "params": params}


def _first_run(ctx: RunContext, root: str, stop_at: int) -> list[Any]:
    reference = train(ctx, f"{root}/ref", 1, None, False)
    return [reference, train(ctx, f"{root}/state", 1, stop_at, False)]


@pytest.mark.dist
def test_resume_at_another_world_size_keeps_every_optimizer_step(tmp_path: Path) -> None:
    stop_at = 5  # mid-epoch: 8 steps per epoch
    (reference, interrupted), *_ = run_world(_first_run, world_size=4, timeout=TIMEOUT,
                                             args=(str(tmp_path), stop_at))  # fmt: skip
    assert len(reference["losses"]) == EPOCHS * N // 8
    assert interrupted["losses"] == reference["losses"][:stop_at]
    for world_size, accum in [(2, 2), (1, 4)]:
        resumed = run_world(train, world_size=world_size, timeout=TIMEOUT,
                            args=(f"{tmp_path}/state", accum, None, True))  # fmt: skip
        for rank_result in resumed:
            losses = interrupted["losses"] + rank_result["losses"]
            torch.testing.assert_close(
                torch.tensor(losses, dtype=torch.float64),
                torch.tensor(reference["losses"], dtype=torch.float64),
                rtol=1e-6, atol=0,
            )  # fmt: skip
            for a, b in zip(rank_result["params"], reference["params"], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_changed_global_batch_is_refused_with_its_three_numbers() -> None:
    saved = _loader(RunContext(rank=0, world_size=4))
    saved.position = 3
    state = saved.state_dict()
    assert state["samples"] == 24  # 3 batches x 2 samples x 4 ranks
    fewer = _loader(RunContext(rank=1, world_size=2, grad_accum_steps=1))
    with pytest.raises(ValueError, match=r"per-rank batch 2 x world size 4 x grad_accum_steps 1, "
                       r"resumed with 2 x 2 x 1.*grad_accum_steps=2"):  # fmt: skip
        fewer.load_state_dict(state)
    matching = _loader(RunContext(rank=1, world_size=2, grad_accum_steps=2))
    matching.load_state_dict(state)
    assert matching.position == 6  # 24 samples at 4 per step: batch 6 of this rank next
    first = next(iter(matching))[0]
    reference = _loader(RunContext(rank=1, world_size=2, grad_accum_steps=2))
    assert torch.equal(first, list(reference)[6][0])  # the batch the uninterrupted run takes


def _load_rng_at_two(ctx: RunContext, directory: str) -> int:
    import warnings

    ctx = dataclasses.replace(ctx, seed=30)
    torch.manual_seed(999)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accel.load_state(ctx, directory, steps=Steps())
    return torch.initial_seed()


@pytest.mark.dist
def test_a_rank_the_saved_run_did_not_have_is_seeded_from_the_run_seed(tmp_path: Path) -> None:
    torch.manual_seed(7)
    accel.save_state(RunContext.single(), tmp_path / "state", steps=Steps())
    seeds = run_world(_load_rng_at_two, world_size=2, timeout=TIMEOUT,
                      args=(str(tmp_path / "state"),))  # fmt: skip
    assert seeds == [7, 31]  # rank 0 restored its saved state; rank 1 = seed 30 + rank 1
