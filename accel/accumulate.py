"""Gradient accumulation: all-reduce gradients once per optimizer step, not once per batch.

`should_sync` is the pure rule; `accumulate` applies it to a DDP or FSDP2 model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from accel._groups import comm_device, named_collective, require_group
from accel.context import RunContext, along

__all__ = ["accumulate", "num_items_in_batch", "should_sync"]


def should_sync(step: int, every: int, *, is_last: bool = False) -> bool:
    """Whether micro-step `step` (counted from 0) ends an accumulation window of `every`.

    Example:

    >>> [should_sync(s, 3) for s in range(6)]
    [False, False, True, False, False, True]
    >>> should_sync(0, 3, is_last=True)
    True
    """
    if every < 1:
        raise ValueError(f"should_sync: every={every} must be >= 1 (the accumulation steps).")
    if step < 0:
        raise ValueError(f"should_sync: step={step} must be >= 0 (the micro-step, from 0).")
    return is_last or (step + 1) % every == 0


@contextmanager
def accumulate(
    ctx: RunContext, model: nn.Module, step: int, *, is_last: bool = False
) -> Iterator[bool]:
    """Run micro-step `step`'s forward and backward inside; yields `sync`.

    On micro-steps that do not end a window of `ctx.grad_accum_steps` (and are not the last batch
    of the data, `is_last`), gradients stay local: DDP's `no_sync`, FSDP2's
    `set_requires_gradient_sync(False)`. On the boundary they are all-reduced once; step the
    optimizer when `sync` is True. Put both forward and backward inside the block.

    Example:

    >>> from accel import RunContext
    >>> ctx = RunContext.single(grad_accum_steps=2)
    >>> model = nn.Linear(2, 1)
    >>> syncs = []
    >>> for step in range(4):
    ...     with accumulate(ctx, model, step) as sync:
    ...         model(torch.ones(1, 2)).sum().backward()
    ...     syncs.append(sync)
    >>> syncs
    [False, True, False, True]
    """
    sync = should_sync(step, ctx.grad_accum_steps, is_last=is_last)
    if sync or ctx.world_size == 1:
        yield sync
        return
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    inner = getattr(model, "_orig_mod", model)  # look through torch.compile
    if isinstance(inner, DistributedDataParallel):
        with inner.no_sync():
            yield False
    elif isinstance(inner, FSDPModule):
        inner.set_requires_gradient_sync(False)
        try:
            yield False
        finally:
            inner.set_requires_gradient_sync(True)
    else:
        yield False


def _labels(batch: Any) -> torch.Tensor:
    if isinstance(batch, torch.Tensor):
        return batch
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if isinstance(labels, torch.Tensor):
        return labels
    raise TypeError(
        f"num_items_in_batch: a batch of type {type(batch).__name__} has no labels; pass the "
        "label tensors, or dicts with a 'labels' tensor."
    )


def num_items_in_batch(ctx: RunContext, batches: Iterable[Any], *, ignore_index: int = -100) -> int:
    """Count the labels that are not `ignore_index` in `batches`, summed over the dp ranks.

    Pass the micro-batches of one optimizer step (label tensors, or dicts with "labels").
    For a loss that is the mean over every token of the global batch under accumulation and
    data parallelism, sum the per-token loss and scale it so DDP's average over ranks and
    `scaled_backward`'s division by `grad_accum_steps` cancel::

        n = num_items_in_batch(ctx, window)
        scale = ctx.dp_size * ctx.grad_accum_steps / n
        loss = F.cross_entropy(logits, y, reduction="sum") * scale

    Example:

    >>> from accel import RunContext
    >>> num_items_in_batch(RunContext.single(), [torch.tensor([1, -100, 3]), torch.tensor([5])])
    3
    """
    ctx = along(ctx, "dp")  # tensor- and context-parallel peers hold the same labels
    count = torch.zeros((), dtype=torch.int64)
    for batch in batches:
        count += _labels(batch).ne(ignore_index).sum().cpu()
    if ctx.world_size > 1:
        group = require_group(ctx, "num_items_in_batch")
        count = count.to(comm_device(ctx))
        with named_collective(ctx, "num_items_in_batch"):
            dist.all_reduce(count, group=group)
    return int(count.item())
