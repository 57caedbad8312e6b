"""Local SGD: train without gradient all-reduce, average the parameters every K steps.

The equivalent of Accelerate's `LocalSGD(accelerator, model, local_sgd_steps)`, without its
hidden step counter: `local_sgd(ctx, model)` turns DDP's gradient all-reduce off for the block,
and `local_sgd_step(ctx, model, step=..., every=K)` after each optimizer step averages the
parameters over the data-parallel ranks when `step` ends a window of K.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accel._groups import require_group
from accel.accumulate import should_sync
from accel.context import RunContext, along

__all__ = ["average_parameters", "local_sgd", "local_sgd_step"]


def _check_model(fn: str, model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule  # on use: importing FSDP costs start-up time

    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}: model must be an nn.Module, got {type(model).__name__}.")
    sharded = isinstance(model, FSDPModule) or any(
        isinstance(m, FSDPModule) for m in model.modules()
    )
    if sharded:
        raise NotImplementedError(
            f"{fn}: model={type(model).__name__} is sharded by FSDP2, whose parameters are "
            "shards that local SGD cannot average; use it with DDP (dp_replicate) or an "
            "unwrapped model."
        )


@contextlib.contextmanager
def local_sgd(ctx: RunContext, model: nn.Module) -> Iterator[None]:
    """Turn off DDP's gradient all-reduce inside the block; average the parameters on exit.

    Put the whole training loop inside, and call `local_sgd_step` after each optimizer step.
    With a plain (unwrapped) model there is no all-reduce to turn off. On one data-parallel
    rank (`ctx.dp_size == 1`) it does nothing. Leaving the block normally averages the
    parameters once more, so every rank holds the same model afterwards (as Accelerate's
    `LocalSGD.__exit__`); an exception leaves them as they are.

    Args:
        ctx: the run's context; parameters are averaged over `along(ctx, "dp")`.
        model: the model `wrap_model` returned (DDP or unwrapped; FSDP2 is refused).

    Yields:
        None.

    Raises:
        NotImplementedError: for a model sharded by FSDP2.
        TypeError: when `model` is not an nn.Module.

    Example:
        >>> import torch, accel
        >>> ctx, model = accel.RunContext(), torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> averaged = []
        >>> with accel.local_sgd(ctx, model):
        ...     for step in range(4):
        ...         model(torch.ones(1, 2)).sum().backward()
        ...         opt.step(); opt.zero_grad()
        ...         averaged.append(accel.local_sgd_step(ctx, model, step=step, every=2))
        >>> averaged
        [False, True, False, True]
    """
    _check_model("local_sgd", model)
    if ctx.dp_size == 1:
        yield
        return
    no_sync = (
        model.no_sync() if isinstance(model, DistributedDataParallel) else contextlib.nullcontext()
    )
    with no_sync:
        yield
    average_parameters(ctx, model)


def local_sgd_step(ctx: RunContext, model: nn.Module, *, step: int, every: int) -> bool:
    """Average the parameters over the data-parallel ranks when optimizer step `step` ends a window.

    Call it on every rank after each optimizer step, inside `local_sgd`. Step `step` (counted
    from 0) ends a window when `(step + 1) % every == 0`, as `should_sync` counts.

    Args:
        ctx: the run's context; averages over `along(ctx, "dp")`.
        model: the model being trained.
        step: the optimizer step just taken, counted from 0.
        every: optimizer steps per window (Accelerate's `local_sgd_steps`), an int >= 1.

    Returns:
        True when the parameters were averaged (on one data-parallel rank: when a window ended).

    Raises:
        ValueError: for `every < 1` or `step < 0`.

    Example:
        >>> import torch, accel
        >>> accel.local_sgd_step(accel.RunContext(), torch.nn.Linear(2, 1), step=3, every=4)
        True
    """
    if every < 1:
        raise ValueError(
            f"local_sgd_step: every={every} must be >= 1 (optimizer steps between averages)."
        )
    if step < 0:
        raise ValueError(f"local_sgd_step: step={step} must be >= 0 (the optimizer step, from 0).")
    if not should_sync(step, every):
        return False
    average_parameters(ctx, model)
    return True


def average_parameters(ctx: RunContext, model: nn.Module) -> None:
    """Replace every parameter by its mean over the data-parallel ranks, in place.

    Args:
        ctx: the run's context; averages over `along(ctx, "dp")` (nothing on one dp rank).
        model: the model whose parameters to average; the same structure on every rank.

    Raises:
        NotImplementedError: for a model sharded by FSDP2.

    Example:
        >>> import torch, accel
        >>> accel.average_parameters(accel.RunContext(), torch.nn.Linear(2, 1))
    """
    _check_model("average_parameters", model)
    if ctx.dp_size == 1:
        return
    dp = along(ctx, "dp")
    group = require_group(dp, "average_parameters")
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in model.parameters():
        by_dtype.setdefault(param.dtype, []).append(param)
    with torch.no_grad():
        for same in by_dtype.values():
            # One all-reduce per dtype instead of one per parameter.
            flat = torch.cat([p.reshape(-1) for p in same])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat /= dp.world_size
            offset = 0
            for p in same:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
