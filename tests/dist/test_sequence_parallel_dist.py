"""Ulysses sequence parallelism (sp) at 2 and 4 gloo ranks equals the same model at sp=1.

Each mesh trains the small Llama-style model of `tests/models.py` for 20 SGD steps with its
batches from `shard_loader` (which cuts each sequence over sp) under the device canary (batches
on the device, NCCL's rule for the all-to-alls); the parent trains the same model on the whole
global batch in one process. Losses, gradient norms, the first step's gradients and the final
parameters must agree to fp32 round-off.

Tolerance: 1e-5 relative. The sp run computes the same products on the same numbers; what
differs is the order of sums (a weight's gradient is the sum of sp slices' partial sums reduced
by FSDP2 instead of one sum over all tokens; matmuls over fewer rows block differently). One
fp32 rounding is 6e-8 relative, and such reorderings move a result by a few of them; over 20
steps of SGD with momentum they compound to ~1e-6 (measured: see the docs), so 1e-5 leaves a
margin while a wrong slice, a lost head or a missing sp reduction moves the loss by > 1e-2.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import accel
from accel import Parallelism
from accel._mesh import with_mesh
from accel.testing import device_canary, run_world
from tests.dist._sgd import train_on_mesh
from tests.models import TP_PLAN, batches, make_model, max_relative, sgd_reference

pytestmark = pytest.mark.dist

STEPS, GLOBAL_BATCH, LR, MAX_NORM, RESUME_AT = 20, 4, 0.5, 1.0, 10
SP_PLAN = ("layers.*.attention",)
FOUR_RANKS = {  # name -> (mesh, options)
    "sp4_activation_checkpointing": (Parallelism(sp=4), {"ac": True}),
    "dp_shard2xsp2": (Parallelism(dp_shard=2, sp=2), {}),
    "tp2xsp2": (Parallelism(tp=2, sp=2), {}),
}


def _pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) per sample, step-major: sequences of 8 tokens, divisible by sp=4."""
    tokens = batches(STEPS, GLOBAL_BATCH).flatten(0, 1)
    return [(t[:-1], t[1:]) for t in tokens]


def _loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _on(ctx: accel.RunContext, parallelism: Parallelism) -> accel.RunContext:
    """The world's context with another mesh (one world runs several meshes in turn)."""
    torch.set_num_threads(1)  # ranks share the cores: one thread each, no oversubscription
    return with_mesh(dataclasses.replace(ctx, parallelism=None, mesh=None), parallelism,
                     source="test")  # fmt: skip


def _wrap(ctx: accel.RunContext, model: torch.nn.Module, ac: bool = False) -> torch.nn.Module:
    p = ctx.parallelism
    assert p is not None
    return accel.wrap_model(
        ctx, model, tp_plan=TP_PLAN if p.tp > 1 else None,
        sp_plan=SP_PLAN if p.sp > 1 else None,
        activation_checkpointing=ac,
    )  # fmt: skip


def _train(
    ctx: accel.RunContext,
    options: dict[str, Any],
    steps: tuple[int, int] = (0, STEPS),
    state: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """Train steps [first, last) of the run; `state`: ("save" or "load", folder) at the ends."""
    p = ctx.parallelism
    assert p is not None
    model = _wrap(ctx, make_model(), options.get("ac", False))
    loader = accel.shard_loader(ctx, DataLoader(_pairs(), batch_size=GLOBAL_BATCH // ctx.dp_size))

    def loss_of(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        assert batch[0].shape[1] == 8 // ctx.sp_size  # this rank's slice of the sequence
        return _loss(model, *batch)

    return train_on_mesh(ctx, model, loader, loss_of, lr=LR, max_norm=MAX_NORM, steps=steps,
                         state=state)  # fmt: skip


@cache
def _reference() -> dict[str, Any]:
    """sp=1: one process, the whole global batch per step."""
    data = DataLoader(_pairs(), batch_size=GLOBAL_BATCH)
    return sgd_reference(make_model(), data, lambda m, b: _loss(m, *b), lr=LR, max_norm=MAX_NORM)


def _sliced_attention_loss(sp: int) -> float:
    """The first step's loss if each slice attended over itself only (sp without Ulysses)."""
    inputs, targets = next(iter(DataLoader(_pairs(), batch_size=GLOBAL_BATCH)))
    model, n = make_model(), 8 // sp
    with torch.no_grad():
        parts = [_loss(model, inputs[:, i : i + n], targets[:, i : i + n]) for i in range(0, 8, n)]
    return float(torch.stack(parts).mean())


def _check(results: list[dict[str, Any]], sp: int) -> None:
    ref = _reference()
    worst = 0.0
    for rank, out in enumerate(results):
        assert len(out["losses"]) == STEPS
        assert out["losses"] == pytest.approx(ref["losses"], rel=1e-5), rank
        assert out["norms"] == pytest.approx(ref["norms"], rel=1e-5), rank
        assert max_relative(out["grads"], ref["grads"]) <= 1e-5, rank
        assert max_relative(out["params"], ref["params"]) <= 1e-5, rank
        gaps = [abs(a - b) / b for a, b in zip(out["losses"], ref["losses"], strict=True)]
        worst = max(worst, *gaps, max_relative(out["params"], ref["params"]))
    print(f"largest relative gap to sp=1 over {STEPS} steps: {worst:.1e}")
    # the comparison can fail: attention over each slice alone is far from the whole sequence's
    assert abs(_sliced_attention_loss(sp) - ref["losses"][0]) > 1e-3


def _two_ranks(ctx: accel.RunContext, folder: str) -> dict[str, Any]:
    whole = _train(_on(ctx, Parallelism(sp=2)), {})
    _train(_on(ctx, Parallelism(sp=2)), {}, (0, RESUME_AT), ("save", folder))
    resumed = _train(_on(ctx, Parallelism(dp_shard=2)), {}, (RESUME_AT, STEPS), ("load", folder))
    return {"whole": whole, "resumed": resumed}


def test_sp2_equals_sp1_over_20_steps_and_resumes_at_sp1(tmp_path: Path) -> None:
    with device_canary():
        results = run_world(_two_ranks, world_size=2, args=(str(tmp_path / "state"),),
                            timeout=300)  # fmt: skip
    _check([r["whole"] for r in results], 2)
    ref = _reference()
    for out in results:  # saved at sp=2 after 10 steps, resumed at sp=1 (dp_shard=2)
        assert out["resumed"]["losses"] == pytest.approx(ref["losses"][RESUME_AT:], rel=1e-5)
        assert max_relative(out["resumed"]["params"], ref["params"]) <= 1e-5


def _pipeline(ctx: accel.RunContext) -> list[float]:
    """pp=2 x sp=2: each stage's attention splits its sequence over its sp peers."""
    ctx = _on(ctx, Parallelism(pp=2, sp=2))

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    stages = accel.pipeline_stages(ctx, make_model(), loss_fn=loss_fn, microbatches=2,
                                   schedule="gpipe", wrap=lambda m: _wrap(ctx, m))  # fmt: skip
    opt = torch.optim.SGD(stages.parameters(), lr=LR, momentum=0.9)
    loader = accel.shard_loader(ctx, DataLoader(_pairs(), batch_size=GLOBAL_BATCH))
    world = dataclasses.replace(ctx, parallelism=None, mesh=None)
    losses = []
    for _, (inputs, targets) in zip(range(RESUME_AT), loader, strict=False):
        loss = accel.pipeline_step(ctx, stages, inputs, targets)
        accel.clip_grad_norm_(ctx, stages.parameters(), MAX_NORM)
        accel.optimizer_step(ctx, opt)
        opt.zero_grad()
        losses.append(accel.reduce(world, loss, op="mean").item())
    return losses


def _data(ctx: accel.RunContext) -> dict[str, Any]:
    """dp_shard=2 x sp=2: dict batches cut over sp, counted over dp x sp, gathered whole."""
    ctx = _on(ctx, Parallelism(dp_shard=2, sp=2))
    ids = torch.arange(5 * 8).view(5, 8)
    rows = [{"input_ids": r, "labels": r} for r in ids]
    loader = accel.shard_loader(ctx, DataLoader(rows, batch_size=2))
    seen, counts, gathered = [], [], []
    for batch in loader:
        seen.append((batch["input_ids"].tolist(), batch["position_ids"].tolist()))
        counts.append(accel.num_items_in_batch(ctx, [batch], shift=True))
        gathered += accel.gather_for_metrics(ctx, batch["input_ids"], loader=loader).tolist()
    return {"seen": seen, "counts": counts, "gathered": gathered}


def _four_ranks(ctx: accel.RunContext, name: str) -> Any:
    if name == "pipeline":
        return _pipeline(ctx)
    if name == "data":
        return _data(ctx)
    return _train(_on(ctx, FOUR_RANKS[name][0]), FOUR_RANKS[name][1])


@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_sp_meshes_at_four_ranks_equal_sp1_over_20_steps(name: str) -> None:
    with device_canary():
        results = run_world(_four_ranks, world_size=4, args=(name,), timeout=300)
    _check(results, FOUR_RANKS[name][0].sp)


def test_pipeline_stages_with_sp_equal_sp1() -> None:
    with device_canary():
        results = run_world(_four_ranks, world_size=4, args=("pipeline",), timeout=300)
    for losses in results:
        assert losses == pytest.approx(_reference()["losses"][:RESUME_AT], rel=1e-5)


def test_loader_counts_and_gather_for_metrics_under_sp() -> None:
    with device_canary():
        results = run_world(_four_ranks, world_size=4, args=("data",), timeout=120)
    for rank, out in enumerate(results):
        dp, sp = rank // 2, rank % 2  # mesh dp_shard x sp, sp inner
        first = out["seen"][0]
        start = 16 * dp + 4 * sp  # samples 2 dp and 2 dp + 1, this sp rank's 4 tokens
        assert first[0] == [list(range(start, start + 4)), list(range(start + 8, start + 12))]
        assert first[1] == [list(range(4 * sp, 4 * sp + 4))] * 2  # global positions
        # 7 shifted targets a sequence, 4 sequences a step (the last step's padding repeats
        # samples, which the loss scores too); one count for all four ranks
        assert out["counts"] == [4 * 7, 4 * 7]
        assert out["gathered"] == [list(range(8 * i, 8 * i + 8)) for i in range(5)]
