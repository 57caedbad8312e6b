"""A DeepSpeed run saved with save_checkpoint and resumed in new processes ends bit-identical.

Each case (ZeRO-1, ZeRO-2 bf16, ZeRO-3 bf16, ZeRO-3 with the optimizer offloaded) trains
STEPS optimizer steps at 2 gloo ranks with accumulation 2 and a scheduler, saving at step SAVE
through accel's checkpoint (engine, optimizer and scheduler in one dict). A second world of
fresh processes builds the same engine, loads the latest checkpoint and trains the remaining
steps: its losses and its final weights, whole and as each rank's fp32 master partition, equal
the uninterrupted run's exactly. The ranks run with torch's deterministic algorithms, which
fill fresh allocations with NaN, so every byte compared must have been written by the run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accel
from accel.checkpoint._deepspeed_state import engine_state
from accel.testing import run_world
from tests.dist.test_deepspeed_dist import _ds_config, _launcher_env

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS, SAVE, ACCUM, MICRO = 5, 2, 2, 4
CASES = (  # (name, ZeRO stage, offload the optimizer, precision)
    ("zero1-fp32", 1, False, "fp32"),
    ("zero2-bf16", 2, False, "bf16"),
    ("zero3-bf16", 3, False, "bf16"),
    ("zero3-offload-fp32", 3, True, "fp32"),
)


def _batch(ctx: accel.RunContext, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * micro_step + ctx.rank)
    return torch.randn(MICRO, 8, generator=g), torch.randn(MICRO, 1, generator=g)


class RunningMean(nn.Module):
    """Keeps a running mean of its inputs in a buffer (as BatchNorm keeps its statistics)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(x.mean(0).to(self.mean.dtype), alpha=0.1)
        return x


def _model() -> nn.Module:
    """With a buffer that training changes: ZeRO-3 partitions only the parameters, so the
    buffers must come back from the checkpoint too."""
    torch.manual_seed(0)
    return nn.Sequential(
        RunningMean(8), nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
        nn.Linear(32, 1),
    )  # fmt: skip


def _engine(ctx: accel.RunContext, stage: int, offload: bool) -> tuple[Any, Any, Any]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = accel.DeepSpeedOptions(
        config=_ds_config(stage, offload), optimizer=optimizer, micro_batch_size=MICRO
    )
    engine = accel.wrap_model(ctx, model, strategy="deepspeed", deepspeed=options)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return engine, optimizer, scheduler


def _masters(engine: Any) -> list[torch.Tensor]:
    state = engine.optimizer.state_dict()
    key = "fp32_flat_groups" if "fp32_flat_groups" in state else "single_partition_of_fp32_groups"
    return [t.detach().clone() for t in state[key]]


def _train(
    ctx: accel.RunContext, engine: Any, optimizer: Any, scheduler: Any, root: Path, first: int
) -> list[float]:
    """The user's loop from optimizer step `first`, saving after step SAVE."""
    losses = []
    for micro in range(first * ACCUM, STEPS * ACCUM):
        with accel.accumulate(ctx, engine, micro) as sync:
            xb, yb = _batch(ctx, micro)
            with accel.autocast(ctx):
                loss = F.mse_loss(engine(xb).float(), yb)
            accel.scaled_backward(ctx, loss)
        if not sync and micro == 0:  # partial gradients sit in ZeRO's buffers: refused
            with pytest.raises(RuntimeError, match="inside a gradient accumulation window"):
                accel.save_state(ctx, root / "window", model=engine)
        if sync:
            assert accel.optimizer_step(ctx, optimizer)
            optimizer.zero_grad()
            scheduler.step()
            if (micro + 1) // ACCUM == SAVE:
                state = {"model": engine, "optimizer": optimizer, "scheduler": scheduler}
                accel.save_checkpoint(ctx, root, state, step=SAVE)
        losses.append(accel.reduce(ctx, loss.detach(), op="mean").item())
    return losses


def _world(ctx: accel.RunContext, tmp: str, resume: bool) -> dict[str, Any]:
    _launcher_env(ctx)
    # Fresh memory (torch.empty) reads as NaN in this mode: bytes a run leaves unwritten (as
    # DeepSpeed left ZeRO-3's partition padding) compare unequal every time, not only when an
    # allocation happens to recycle a NaN. This rank is a process of its own: nothing leaks.
    torch.use_deterministic_algorithms(True)
    ctx = dataclasses.replace(ctx, grad_accum_steps=ACCUM)
    out: dict[str, Any] = {}
    for name, stage, offload, precision in CASES:
        c = dataclasses.replace(ctx, precision=precision)
        root = Path(tmp) / name
        engine, optimizer, scheduler = _engine(c, stage, offload)
        first = 0
        if resume:
            latest = accel.latest_checkpoint(root)
            assert latest is not None
            state = {"model": engine, "optimizer": optimizer, "scheduler": scheduler}
            first = accel.load_state(c, latest, state)["step"]
            with pytest.raises(ValueError, match="pass the engine"):
                accel.save_state(c, root / "alone", optimizer=optimizer)
        losses = _train(c, engine, optimizer, scheduler, root, first)
        out[name] = {
            "losses": losses[-(STEPS - SAVE) * ACCUM :],
            "weights": engine_state(engine),
            "masters": _masters(engine),
            "steps": (engine.global_steps, engine.global_samples, scheduler.last_epoch),
        }
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """The uninterrupted runs, with their checkpoints at step SAVE: (folder, each rank's out)."""
    tmp = tmp_path_factory.mktemp("deepspeed")
    return tmp, run_world(_world, world_size=2, timeout=600, args=(str(tmp), False))


def test_a_deepspeed_run_resumed_in_new_processes_ends_bit_identical(
    uninterrupted: tuple[Path, list[dict[str, Any]]],
) -> None:
    tmp, whole = uninterrupted
    resumed = run_world(_world, world_size=2, timeout=600, args=(str(tmp), True))
    for rank in (0, 1):
        for name, *_ in CASES:
            ours, ref = resumed[rank][name], whole[rank][name]
            assert ours["losses"] == ref["losses"], name
            assert ours["steps"] == ref["steps"], name
            for key, value in ref["weights"].items():
                assert torch.equal(ours["weights"][key], value), (name, key)
            assert len(ours["masters"]) == len(ref["masters"])
            for a, b in zip(ours["masters"], ref["masters"], strict=True):
                assert torch.equal(a, b), name


def _load_at_one_rank(ctx: accel.RunContext, tmp: str) -> str:
    _launcher_env(ctx)
    ctx = dataclasses.replace(ctx, grad_accum_steps=ACCUM)
    engine, optimizer, scheduler = _engine(ctx, 1, False)
    before = [p.detach().clone() for p in engine.module.parameters()]
    latest = accel.latest_checkpoint(Path(tmp) / "zero1-fp32")
    state = {"scheduler": scheduler, "model": engine, "optimizer": optimizer}
    with pytest.raises(ValueError) as refused:
        accel.load_state(ctx, latest, state)
    assert scheduler.last_epoch == 0  # refused before anything was loaded
    for p, b in zip(engine.module.parameters(), before, strict=True):
        assert torch.equal(p, b)
    return str(refused.value)


def test_partitions_saved_at_two_ranks_are_refused_at_one_by_name(
    uninterrupted: tuple[Path, list[dict[str, Any]]],
) -> None:
    tmp, _ = uninterrupted
    (message,) = run_world(_load_at_one_rank, world_size=1, timeout=600, args=(str(tmp),))
    assert "ZeRO-1 engine over 2 data-parallel ranks" in message, message
    assert "this engine is ZeRO-1 over 1" in message, message
