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
from accel.parallel.deepspeed import deepspeed_engine

__all__ = ["accumulate", "num_items_in_batch", "should_sync"]


def should_sync(step: int, every: int, *, is_last: bool = False) -> bool:
    """Tell whether micro-step `step` (counted from 0) ends an accumulation window of `every`.

    Args:
        step: the micro-step, counted from 0, an int >= 0.
        every: micro-steps per optimizer step (usually `ctx.grad_accum_steps`), an int >= 1.
        is_last: this is the last micro-batch of the data, so the window ends early; default
            False.

    Returns:
        True when gradients should be synchronised and the optimizer stepped after `step`.

    Raises:
        ValueError: for `every < 1` or `step < 0`.

    Example:

    >>> from accel import should_sync
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
    optimizer when `sync` is True. A DeepSpeed engine is told whether this micro-step is a
    boundary (`set_gradient_accumulation_boundary`), and reduces and steps on its own terms.
    Put both forward and backward inside the block. With `world_size == 1`, or a model that is
    neither DDP nor FSDP2, nothing is skipped.

    Args:
        ctx: the run context; `ctx.grad_accum_steps` is the window length.
        model: the model being trained, as `wrap_model` returned it (a `torch.compile`d one
            too).
        step: the micro-step, counted from 0, an int >= 0.
        is_last: this is the last micro-batch of the data, so sync now; default False.

    Yields:
        `sync`: True when this micro-step ends a window and the optimizer should step.

    Raises:
        ValueError: for `step < 0`.

    Example:

    >>> import torch
    >>> from torch import nn
    >>> from accel import accumulate, RunContext
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
    engine = deepspeed_engine(model)
    if engine is not None:  # the engine reduces and steps on the boundaries it is told
        # The engine's own state, its public flag: save_state refuses off a boundary.
        engine.set_gradient_accumulation_boundary(sync)
        yield sync
        return
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


def _labels(batch: Any, *, sequence_parallel: bool = False) -> torch.Tensor:
    if sequence_parallel:  # a slice cannot shift its labels: count the globally shifted ones
        labels = batch.get("shift_labels") if isinstance(batch, Mapping) else None
        if isinstance(labels, torch.Tensor):
            return labels
        raise ValueError(
            "num_items_in_batch: shift=True under sequence parallelism (sp > 1) counts the "
            "'shift_labels' that shard_loader adds to dict batches with 'labels' (a slice of "
            "the sequence cannot shift its own labels), and this batch "
            f"({type(batch).__name__}) has none. Pass shard_loader's dict batches, or the "
            "already-shifted targets with shift=False."
        )
    if isinstance(batch, torch.Tensor):
        return batch
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if isinstance(labels, torch.Tensor):
        return labels
    raise TypeError(
        f"num_items_in_batch: a batch of type {type(batch).__name__} has no labels; pass the "
        "label tensors, or dicts with a 'labels' tensor."
    )


def num_items_in_batch(
    ctx: RunContext, batches: Iterable[Any], *, shift: bool, ignore_index: int = -100
) -> int:
    """Count the labels the loss will score in `batches`, summed over the data-parallel ranks.

    Pass the micro-batches of one optimizer step (label tensors, or dicts with "labels").
    `shift` says which labels the loss scores, and has no default because guessing it wrong
    mis-scales the loss without an error:

    - `shift=True`: a causal LM (GPT-2 and every transformers `*ForCausalLM`) predicts token
      t + 1 from tokens up to t, so it scores `labels[..., 1:]`: the first label of every
      sequence is never a target;
    - `shift=False`: the labels are the targets as given (already shifted inputs/targets
      pairs, classification, masked LM, seq2seq decoder labels).

    Under sequence parallelism (sp > 1) each sp rank holds a slice of the labels and the count
    sums the slices too; `shift=True` then counts the "shift_labels" `shard_loader` added
    (shifted over the whole sequence). Gradients are averaged over dp x sp ranks, hence the
    `ctx.sp_size` below (1 without sequence parallelism).

    Labels equal to `ignore_index` are not counted. For a loss that is the mean over every
    scored token of the global batch under accumulation and data parallelism, sum the
    per-token loss and scale it so DDP's average over ranks and `scaled_backward`'s division
    by `grad_accum_steps` cancel::

        n = num_items_in_batch(ctx, window, shift=True)
        scale = ctx.dp_size * ctx.sp_size * ctx.grad_accum_steps / n
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                               reduction="sum") * scale

    Args:
        ctx: the run context; with `world_size > 1` the count is all-reduced. Call it on every
            rank.
        batches: this rank's micro-batches of one optimizer step: label tensors, or mappings
            with a "labels" tensor.
        shift: count `labels[..., 1:]` (causal LM) instead of every label.
        ignore_index: the label value that is not counted; default -100, as in
            `F.cross_entropy`.

    Returns:
        The global number of scored labels, over all batches and all ranks.

    Raises:
        TypeError: for a batch that is neither a tensor nor a mapping with a "labels" tensor.
        RuntimeError: when `world_size > 1` and no process group is initialised, or the
            all-reduce fails.

    Example:

    >>> import torch
    >>> from accel import num_items_in_batch, RunContext
    >>> labels = torch.tensor([[5, 6, 7, -100], [8, 9, -100, -100]])
    >>> num_items_in_batch(RunContext.single(), [{"labels": labels}], shift=True)
    3
    >>> num_items_in_batch(RunContext.single(), [{"labels": labels}], shift=False)
    5
    """
    count = torch.zeros((), dtype=torch.int64)
    for batch in batches:
        labels = _labels(batch, sequence_parallel=shift and ctx.sp_size > 1)
        if shift and ctx.sp_size == 1:
            labels = labels[..., 1:]
        count += labels.ne(ignore_index).sum().cpu()
    # tensor- and context-parallel peers hold the same labels; sp peers each hold a slice
    for dim in ("sp", "dp") if ctx.sp_size > 1 else ("dp",):
        count = _sum_over(along(ctx, dim), count)
    return int(count.item())


def _sum_over(ctx: RunContext, count: torch.Tensor) -> torch.Tensor:
    if ctx.world_size > 1:
        group = require_group(ctx, "num_items_in_batch")
        count = count.to(comm_device(ctx))
        with named_collective(ctx, "num_items_in_batch"):
            dist.all_reduce(count, group=group)
    return count
