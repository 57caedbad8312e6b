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
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import accel
from accel import FSDPOptions, Parallelism
from accel.testing import device_canary, run_world
from tests.models import TP_PLAN, Block, batches, full_param, make_model

pytestmark = pytest.mark.dist

STEPS, GLOBAL_BATCH, LR, MAX_NORM = 20, 4, 0.5, 1.0
SP_PLAN = ("layers.*.attention",)


def _pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) per sample, step-major: sequences of 8 tokens, divisible by sp=4."""
    tokens = batches(STEPS, GLOBAL_BATCH).flatten(0, 1)
    return [(t[:-1], t[1:]) for t in tokens]


def _loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _train(ctx: accel.RunContext, options: dict[str, Any]) -> dict[str, Any]:
    p = ctx.parallelism
    assert p is not None
    model = accel.wrap_model(
        ctx, make_model(), tp_plan=TP_PLAN if p.tp > 1 else None,
        fsdp=FSDPOptions(layer_classes=(Block,)), sp_plan=SP_PLAN,
        activation_checkpointing=options.get("ac", False),
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    loader = accel.shard_loader(ctx, DataLoader(_pairs(), batch_size=GLOBAL_BATCH // ctx.dp_size))
    world = dataclasses.replace(ctx, parallelism=None, mesh=None)
    losses, norms, grads = [], [], None
    for inputs, targets in loader:
        assert inputs.shape[1] == 8 // ctx.sp_size  # this rank's slice of the sequence
        loss = _loss(model, inputs, targets)
        accel.scaled_backward(ctx, loss)
        if grads is None:
            grads = {n: full_param(q.grad) for n, q in accel.unwrap_model(model).named_parameters()}
        norms.append(accel.clip_grad_norm_(ctx, model, MAX_NORM).item())
        assert accel.optimizer_step(ctx, opt)
        opt.zero_grad()
        # every rank scores as many tokens, so the mean over the world is the global mean
        losses.append(accel.reduce(world, loss.detach(), op="mean").item())
    params = {n: full_param(q) for n, q in accel.unwrap_model(model).named_parameters()}
    return {"losses": losses, "norms": norms, "grads": grads, "params": params}


@cache
def _reference() -> dict[str, Any]:
    """sp=1: one process, the whole global batch per step."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, norms, grads = [], [], None
    for inputs, targets in DataLoader(_pairs(), batch_size=GLOBAL_BATCH):
        loss = _loss(model, inputs, targets)
        loss.backward()
        if grads is None:
            grads = {n: q.grad.detach().clone() for n, q in model.named_parameters()}
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: q.detach().clone() for n, q in model.named_parameters()}
    return {"losses": losses, "norms": norms, "grads": grads, "params": params}


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max()) for n in a)


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
        assert out["losses"] == pytest.approx(ref["losses"], rel=1e-5), rank
        assert out["norms"] == pytest.approx(ref["norms"], rel=1e-5), rank
        assert _relative(out["grads"], ref["grads"]) <= 1e-5, rank
        assert _relative(out["params"], ref["params"]) <= 1e-5, rank
        gaps = [abs(a - b) / b for a, b in zip(out["losses"], ref["losses"], strict=True)]
        worst = max(worst, *gaps, _relative(out["params"], ref["params"]))
    print(f"largest relative gap to sp=1 over {STEPS} steps: {worst:.1e}")
    # the comparison can fail: attention over each slice alone is far from the whole sequence's
    assert abs(_sliced_attention_loss(sp) - ref["losses"][0]) > 1e-3


def test_sp2_equals_sp1_over_20_steps() -> None:
    with device_canary():
        results = run_world(_train, world_size=2, args=({},), parallelism=Parallelism(sp=2))
    _check(results, 2)
