"""A learning-rate schedule shorter than the training is said at the step where it shows: an
optimizer step with every learning rate at 0 once the optimizer has stepped (issue 44 item 3:
`shard_loader` called where the DataLoader is built sized an Accelerate-style schedule from the
per-process length, and at 2 processes the LR reached 0 halfway, silently)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import accel
from accel import RunContext

CTX = RunContext(rank=0, world_size=2)  # rank 0 of 2: shard_loader halves the length
DATA = torch.randn(32, 2)  # 16 batches of 2: 8 a rank


def _train(scheduler_from: str) -> list[float]:
    """The no_trainer scripts' loop, the schedule kept as Accelerate's script writes it
    (stepped world_size times per optimizer step, docs/migration.md block 5)."""
    model = nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    loader = DataLoader(DATA, batch_size=2)
    if scheduler_from == "sharded":  # shard_loader where the DataLoader is built
        loader = accel.shard_loader(CTX, loader)
    total = len(loader)  # the script's max_train_steps: one epoch, no accumulation
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=total)
    if scheduler_from == "unsharded":  # shard_loader where prepare was
        loader = accel.shard_loader(CTX, loader)
    rates = []
    for x in loader:
        model(x).pow(2).mean().backward()
        rates.append(optimizer.param_groups[0]["lr"])
        accel.optimizer_step(CTX, optimizer)
        for _ in range(CTX.world_size):
            scheduler.step()
        optimizer.zero_grad()
    return rates


def test_a_schedule_sized_from_the_sharded_length_is_said_where_its_rate_reaches_zero() -> None:
    with pytest.warns(UserWarning, match=r"optimizer_step: every learning rate is 0") as caught:
        rates = _train("sharded")
    assert rates[4:] == [0.0] * 4  # the LR reached 0 halfway: what the warning is about
    assert {str(w.message) for w in caught} == {str(caught[0].message)}
    assert "shard_loader" in str(caught[0].message) and caught[0].filename == __file__


def test_a_schedule_sized_before_shard_loader_runs_to_its_end_without_a_word() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rates = _train("unsharded")
    assert rates[0] == 0.1 and 0.0 not in rates  # reaches 0 after the last step only


def test_a_warmup_from_zero_is_no_alarm() -> None:
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(step / 2, 1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):  # the first step runs at LR 0, before the optimizer ever stepped
            model(torch.ones(1, 2)).sum().backward()
            accel.optimizer_step(RunContext.single(), optimizer)
            scheduler.step()
            optimizer.zero_grad()
