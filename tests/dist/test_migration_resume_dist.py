"""docs/migration.md's one-ahead recipe (block 6: a collator that draws random numbers, as
MLM masking does, with a model that draws too) saved in the middle of an epoch and resumed, at
1 and 2 processes: every batch is seen exactly once, and the per-step losses equal those of the
uninterrupted run (issue 44 item 2: the resumed MLM run trained 15 of its 16 batches)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import accel
from accel import RunContext
from accel.testing import run_world

EPOCHS, SAMPLES, BATCH, SAVE_AT = 2, 16, 2, 2  # SAVE_AT: the optimizer step saved after


def one_ahead_recipe() -> type:
    """The `OneAhead` class of docs/migration.md block 6, as the page writes it."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "migration.md").read_text()
    block = next(b for b in page.split("```python")[1:] if "class OneAhead" in b)
    tree = ast.parse(block.split("```")[0])
    recipe = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "OneAhead")
    namespace: dict[str, Any] = {"torch": torch, "accel": accel}
    exec(compile(ast.Module([recipe], []), "docs/migration.md", "exec"), namespace)
    return namespace["OneAhead"]


def _noisy(samples: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A collator that draws from the global RNG; the sample ids travel with the batch."""
    ids = torch.tensor([s[0] for s in samples])
    x = torch.stack([s[1] for s in samples])
    return ids, x + torch.rand(x.shape)


def _data() -> list[tuple[int, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(i, torch.randn(4, generator=g)) for i in range(SAMPLES)]


def _train(ctx: RunContext, directory: str, part: str) -> tuple[list[int], list[float]]:
    """`part`: "all" (uninterrupted), "first" (save after step SAVE_AT and stop) or "rest"
    (load, then go on). Returns the sample ids this rank saw and its losses."""
    accel.set_seed(0 if part != "rest" else 123)  # a resumed process starts elsewhere
    model = accel.wrap_model(ctx, nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = accel.shard_loader(
        ctx, DataLoader(_data(), batch_size=BATCH, shuffle=True, collate_fn=_noisy)
    )
    reader = one_ahead_recipe()(loader)
    if part == "rest":
        accel.load_state(ctx, directory, model=model, optimizer=optimizer, loader=reader)
    seen: list[int] = []
    losses: list[float] = []
    step = 0
    for epoch in range(loader.epoch, EPOCHS):
        loader.set_epoch(epoch)
        for ids, x in reader:
            loss = model(x).pow(2).mean()
            accel.scaled_backward(ctx, loss)
            optimizer.step()
            optimizer.zero_grad()
            seen += ids.tolist()
            losses.append(loss.item())
            step += 1
            if part == "first" and step == SAVE_AT:
                accel.save_state(ctx, directory, model=model, optimizer=optimizer, loader=reader)
                return seen, losses
    return seen, losses


def _world(ctx: RunContext, directory: str) -> dict[str, Any]:
    return {part: _train(ctx, directory, part) for part in ("all", "first", "rest")}


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_one_ahead_resumes_mid_epoch_exactly(tmp_path: Path, world_size: int) -> None:
    results = run_world(_world, world_size=world_size, timeout=120, args=(str(tmp_path / "s"),))
    every = []
    for rank, res in enumerate(results):
        (ids, losses), (ids1, losses1), (ids2, losses2) = res["all"], res["first"], res["rest"]
        assert ids1 + ids2 == ids, f"rank {rank}: the resumed run saw other batches"
        assert losses1 + losses2 == losses, f"rank {rank}: the resumed run trained otherwise"
        every += ids1 + ids2
    assert sorted(every) == sorted(list(range(SAMPLES)) * EPOCHS)  # each sample once an epoch
