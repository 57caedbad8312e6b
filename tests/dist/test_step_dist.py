"""The training-step calls give the gradients of the full-batch, single-process computation.

One `run_world` per world size trains the same tiny models under DDP and FSDP2 with every
accumulation setting; the parent compares against a reference it computes itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import accel
from accel.testing import device_canary, run_world
from tests.models import TokenModel

pytestmark = pytest.mark.dist

GLOBAL_BATCH = 16
STEPS = 3
LR = 0.1


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(GLOBAL_BATCH * STEPS, 4, generator=g), torch.randn(
        GLOBAL_BATCH * STEPS, 1, generator=g
    )


def _mlp() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """GLOBAL_BATCH * STEPS sequences of length 6 whose real lengths vary from 1 to 6."""
    g = torch.Generator().manual_seed(3)
    n = GLOBAL_BATCH * STEPS
    x = torch.randint(0, 7, (n, 6), generator=g)
    y = torch.randint(0, 7, (n, 6), generator=g)
    lengths = torch.randint(1, 7, (n,), generator=g)
    y[torch.arange(6)[None, :] >= lengths[:, None]] = -100
    return x, y


def _params(model: nn.Module) -> list[torch.Tensor]:
    out = []
    for p in accel.unwrap_model(model).parameters():
        full = getattr(p, "full_tensor", None)
        out.append((full() if callable(full) else p).detach().clone())
    return out


def _train(ctx: accel.RunContext, strategy: str, task: str, *, naive: bool = False) -> Any:
    """Train STEPS optimizer steps; each rank takes its contiguous part of each global batch."""
    model = accel.wrap_model(ctx, _mlp() if task == "mse" else TokenModel(), strategy=strategy)  # type: ignore[arg-type]
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, y = (t.to(ctx.device) for t in (_data() if task == "mse" else _tokens()))
    per_rank = GLOBAL_BATCH // ctx.world_size
    micro = per_rank // ctx.grad_accum_steps
    for step in range(STEPS):
        start = step * GLOBAL_BATCH + ctx.rank * per_rank
        window = [
            (
                x[start + m * micro : start + (m + 1) * micro],
                y[start + m * micro : start + (m + 1) * micro],
            )
            for m in range(ctx.grad_accum_steps)
        ]
        n_items = (
            accel.num_items_in_batch(ctx, [yb for _, yb in window], shift=False)
            if task == "tokens"
            else 0
        )
        for m, (xb, yb) in enumerate(window):
            with accel.accumulate(ctx, model, step * ctx.grad_accum_steps + m) as sync:
                out = model(xb)
                if task == "mse":
                    loss = F.mse_loss(out, yb)
                elif naive:
                    loss = F.cross_entropy(out.flatten(0, 1), yb.flatten(), ignore_index=-100)
                else:
                    scale = ctx.world_size * ctx.grad_accum_steps / n_items
                    loss = F.cross_entropy(out.flatten(0, 1), yb.flatten(), reduction="sum") * scale
                accel.scaled_backward(ctx, loss)
            if sync:
                assert accel.optimizer_step(ctx, opt)
                opt.zero_grad()
    return _params(model)


def _count_gradient_reductions(ctx: accel.RunContext, strategy: str) -> int:
    """Gradient collectives issued during STEPS optimizer steps of the MSE task."""
    calls = [0]
    # FSDP2 reduce-scatters through dist.reduce_scatter_single (torch >= 2.10) or
    # reduce_scatter_tensor (earlier); the names are looked up at call time, so counting wraps work.
    names = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single")
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return originals[name](*args, **kwargs)

        return call

    if strategy == "ddp":
        model = accel.wrap_model(ctx, _mlp(), strategy="ddp")

        def hook(state, bucket):  # type: ignore[no-untyped-def]  (DDP checks the annotations)
            calls[0] += 1
            fut = dist.all_reduce(bucket.buffer() / ctx.world_size, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])

        model.register_comm_hook(None, hook)  # type: ignore[operator]
        before = 0
    else:
        model = accel.wrap_model(ctx, _mlp(), strategy="fsdp2")
        for name in originals:
            setattr(dist, name, counting(name))
        before = calls[0]
    try:
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        x, y = (t.to(ctx.device) for t in _data())
        for micro_step in range(STEPS * ctx.grad_accum_steps):
            with accel.accumulate(ctx, model, micro_step) as sync:
                accel.scaled_backward(ctx, F.mse_loss(model(x[:4]), y[:4]))
            if sync:
                accel.optimizer_step(ctx, opt)
                opt.zero_grad()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return calls[0] - before


def _world(ctx: accel.RunContext) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for accum in (1, 2, 4):
        c = dataclasses.replace(ctx, grad_accum_steps=accum)
        for strategy in ("ddp", "fsdp2"):
            results[f"mse-{strategy}-{accum}"] = _train(c, strategy, "mse")
            results[f"tokens-{strategy}-{accum}"] = _train(c, strategy, "tokens")
        results[f"naive-{accum}"] = _train(c, "ddp", "tokens", naive=True)
    if ctx.world_size > 1:
        c = dataclasses.replace(ctx, grad_accum_steps=4)
        results["reductions-ddp"] = _count_gradient_reductions(c, "ddp")
        results["reductions-fsdp2"] = _count_gradient_reductions(c, "fsdp2")
    return results


def _reference(task: str) -> list[torch.Tensor]:
    """Full-batch, single process, no accel: the gradient of the mean over the global batch."""
    model = _mlp() if task == "mse" else TokenModel()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, y = _data() if task == "mse" else _tokens()
    for step in range(STEPS):
        xb, yb = (
            x[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH],
            y[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH],
        )
        out = model(xb)
        if task == "mse":
            loss = F.mse_loss(out, yb)
        else:  # the token-level mean over every real token of the global batch
            loss = F.cross_entropy(out.flatten(0, 1), yb.flatten(), ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _close(a: list[torch.Tensor], b: list[torch.Tensor], rtol: float = 1e-6) -> bool:
    return all(torch.allclose(x, y, rtol=rtol, atol=rtol * 1e-1) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def worlds() -> dict[int, dict[str, Any]]:
    with device_canary():  # batches on the device and NCCL's rule for collectives, as on GPUs
        return {n: run_world(_world, world_size=n, timeout=240)[0] for n in (1, 2, 4)}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("accum", [1, 2, 4])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
@pytest.mark.parametrize("task", ["mse", "tokens"])
def test_parameters_equal_the_full_batch_reference(
    worlds: dict[int, dict[str, Any]], world_size: int, accum: int, strategy: str, task: str
) -> None:
    got = worlds[world_size][f"{task}-{strategy}-{accum}"]
    assert _close(got, _reference(task)), f"{task} {strategy} world={world_size} accum={accum}"


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ddp_and_fsdp2_agree(worlds: dict[int, dict[str, Any]], world_size: int) -> None:
    for accum in (1, 2, 4):
        results = worlds[world_size]
        assert _close(results[f"mse-ddp-{accum}"], results[f"mse-fsdp2-{accum}"])
        assert _close(results[f"tokens-ddp-{accum}"], results[f"tokens-fsdp2-{accum}"])


def test_the_naive_per_batch_mean_differs_from_the_token_mean(
    worlds: dict[int, dict[str, Any]],
) -> None:
    reference = _reference("tokens")
    differs = [
        max(
            (a - b).abs().max().item()
            for a, b in zip(worlds[n][f"naive-{accum}"], reference, strict=True)
        )
        for n in (1, 2, 4)
        for accum in (1, 2, 4)
        if n * accum > 1  # with one micro-batch of the whole global batch the two are the same
    ]
    assert min(differs) > 1e-4, differs


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_one_gradient_reduction_per_optimizer_step(
    worlds: dict[int, dict[str, Any]], world_size: int, strategy: str
) -> None:
    # grad_accum_steps=4 and STEPS optimizer steps: 4 * STEPS backward passes, STEPS reductions.
    assert worlds[world_size][f"reductions-{strategy}"] == STEPS


def _optimizer_before_fsdp2(ctx: accel.RunContext) -> str:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model = accel.wrap_model(ctx, model, strategy="fsdp2")
    F.mse_loss(model(torch.ones(2, 4)), torch.zeros(2, 1)).backward()
    try:
        accel.optimizer_step(ctx, opt)
    except ValueError as err:
        return str(err)
    return "no error"


def test_an_optimizer_created_before_fsdp2_is_refused() -> None:
    messages = run_world(_optimizer_before_fsdp2, world_size=2, timeout=120)
    assert all("created before wrap_model" in m and "after wrapping" in m for m in messages), (
        messages
    )
