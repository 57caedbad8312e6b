"""Shard a DataLoader across ranks, resume it mid-epoch, and gather evaluation results exactly.

`shard_loader(ctx, loader)` returns a `ShardedLoader` that iterates like the DataLoader but
yields only this rank's batches (the layout of `ShardPlan`), shuffles the same way on every
rank with a different order every epoch, and records its position so
`state_dict()` / `load_state_dict()` resume exactly where a run stopped, without reading the
samples it skips. `gather_for_metrics` gathers per-sample results from all ranks and drops the
samples that were repeated to even out the last round.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from accel._tree import flatten, unflatten
from accel.collectives import gather, gather_leaves, gather_object, gather_parts, pad_tensor
from accel.context import RunContext, along
from accel.data._loader import ShardedLoader
from accel.data._shard_plan import ShardBatch, ShardPlan
from accel.data._source import Layout
from accel.data._stream import DISPATCH_NEEDS_STREAM
from accel.seeding import check_seed

__all__ = ["ShardBatch", "ShardPlan", "ShardedLoader", "gather_for_metrics", "shard_loader"]


def shard_loader(
    ctx: RunContext,
    loader: DataLoader[Any],
    *,
    even_batches: bool = True,
    split_batches: bool = False,
    device_placement: bool = True,
    non_blocking: bool = False,
    seed: int | None = None,
    dispatch_batches: bool = False,
) -> ShardedLoader:
    """Return this rank's part of `loader`, as Accelerate's `prepare_data_loader` lays it out.

    Batch k of `loader` goes to rank k mod world_size (with `split_batches`, every batch is cut in
    world_size slices instead). With `even_batches` the last round is completed with samples from
    the start of the epoch so all ranks take the same number of steps; `gather_for_metrics` drops
    those repeats. A shuffling loader (`shuffle=True`) gets the same order on every rank, from
    `seed` (default `ctx.seed`, else 0) and the epoch. Batches are moved to `ctx.device` unless
    `device_placement=False`. Map-style datasets keep the loader's workers and pin_memory.
    An iterable dataset that can split itself (`datasets.IterableDataset`, `iter_shard` or
    `shard`) is read by the workers of every rank, each (rank, worker) reading only its part;
    with `dispatch_batches=True` rank 0 reads it and sends every rank its batch; any other is
    read whole by every rank, each keeping its slice (`describe()` says which, and why).
    Under sequence parallelism (`ctx.sp_size > 1`) the sp peers of a data-parallel rank take
    the same batch and each keeps its slice of the sequence: dim 1 of every tensor of 2+ dims,
    cut in sp equal parts (a length sp does not divide is refused); a dict batch gains global
    "position_ids" (beside "input_ids") and "shift_labels" (beside "labels": the next-token
    targets shifted over the whole sequence, as transformers' causal LM loss takes them) before
    the cut.

    Args:
        ctx: the run context; its rank and world size pick the batches, and `ctx.device` is
            where they go.
        loader: a torch `DataLoader`; an iterable dataset needs a `batch_size`.
        even_batches: complete the last round with samples from the start of the epoch, so
            every rank takes the same number of steps; default True.
        split_batches: cut each batch of `loader` into `world_size` slices instead of giving
            whole batches to ranks in turn; the batch size must divide evenly. Default False.
        device_placement: move each batch's tensors to `ctx.device`; default True.
        non_blocking: move them with `non_blocking=True` (useful with pinned memory); default
            False.
        seed: the shuffling seed shared by every rank; default `ctx.seed`, else 0.
        dispatch_batches: rank 0 reads an iterable dataset and sends every rank its batch
            (Accelerate's `dispatch_batches`); default False.

    Returns:
        A `ShardedLoader` yielding this rank's batches. Each full pass advances its epoch (a
        new shuffle; `set_epoch` sets it), and `save_state` saves its position to resume
        mid-epoch.

    Raises:
        TypeError: for a `loader` that is not a torch `DataLoader`, or a `seed` that is not an
            int.
        ValueError: for a `seed` outside [0, 2**63), an iterable dataset without a batch
            size, or `split_batches` with a
            batch size that is missing or not divisible by `world_size`.
        NotImplementedError: for `dispatch_batches=True` with a map-style dataset or with
            `split_batches`.

    Example:

    >>> from accel import RunContext, shard_loader
    >>> from torch.utils.data import DataLoader
    >>> ctx = RunContext(rank=1, world_size=2)
    >>> [b.tolist() for b in shard_loader(ctx, DataLoader(list(range(7)), batch_size=2))]
    [[2, 3], [6, 0]]
    """
    check_seed("shard_loader", seed)
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"shard_loader: loader={type(loader).__name__} is not a torch DataLoader; wrap the "
            "dataset in torch.utils.data.DataLoader(dataset, batch_size=...)."
        )
    if dispatch_batches and (split_batches or not isinstance(loader.dataset, IterableDataset)):
        name = type(loader.dataset).__name__
        raise NotImplementedError(DISPATCH_NEEDS_STREAM.format(name=name, split=split_batches))
    if isinstance(loader.dataset, IterableDataset) and loader.batch_size is None:
        raise ValueError(
            "shard_loader: an iterable dataset needs a DataLoader with a batch_size; the stream "
            "is cut into chunks of world_size * batch_size."
        )
    plan = ShardPlan.for_context(
        ctx,
        batch_size=loader.batch_size,
        split_batches=split_batches,
        even_batches=even_batches,
        # A batch sampler of its own says whether to drop the incomplete round, as Accelerate
        # reads it (the DataLoader's drop_last is False whenever batch_sampler= is given).
        drop_last=loader.drop_last or bool(getattr(loader.batch_sampler, "drop_last", False)),
    )
    if seed is None:
        seed = ctx.seed if ctx.seed is not None else 0
    return ShardedLoader(
        ctx,
        loader,
        plan=plan,
        device_placement=device_placement,
        non_blocking=non_blocking,
        seed=seed,
        dispatch_batches=dispatch_batches,
    )


def gather_for_metrics(ctx: RunContext, tree: Any, *, loader: ShardedLoader) -> Any:
    """Gather per-sample results of the batch `loader` just yielded; every sample counted once.

    `tree` is either a nest of tensors with the batch on dim 0 of each leaf, or a list of Python
    objects with one item per sample (decoded text). Ranks' results are concatenated in rank
    order and the repeats `shard_loader` added to even out the last round are dropped; with
    `even_batches=False`, uneven last batches are padded for the collective and trimmed after.
    Call it on every rank for every batch (also if the loop breaks early: it uses the layout of
    the batch most recently yielded). With `even_batches=False` a rank can run out of batches
    before the others; once its pass has ended it calls `gather_for_metrics(ctx, [],
    loader=loader)` for each round it lacks, and contributes nothing (docs/data.md shows the
    loop).

    Under sequence parallelism (sp > 1) the sequence slices of every tensor of two or more
    dimensions are joined back along dim 1 first (the cut `shard_loader` made), so whole
    sequences are returned; tensors of fewer dimensions are taken as the sp peers hold them
    (one value per sample, the same on each peer).

    Rows that are not one per sample (Accelerate's no_trainer scripts gather
    `loss.repeat(per_device_eval_batch_size)` per batch) follow Accelerate's rule: every rank's
    rows are concatenated in rank order and kept whole, except in the last round when it is
    short of a full step (`len(dataset) % (batch_size * world_size)` real samples, Accelerate's
    `remainder`), where the first that many rows are kept. The mean of the gathered losses
    then equals Accelerate's, bit for bit.

    Args:
        ctx: the run context the loader was made with.
        tree: this rank's per-sample results for the batch: a tensor, or nested tuples, lists
            and dicts of tensors, each with the batch on dim 0; or a list of Python objects
            with one item per sample; `[]` from a rank whose pass has ended.
        loader: the `ShardedLoader` (from `shard_loader`) that yielded the batch.

    Returns:
        Every rank's real samples in rank order, without the repeats: the structure of `tree`
        for tensors, a flat list for Python objects (on one process, this rank's samples).

    Raises:
        TypeError: for a `loader` that is not a `ShardedLoader`, or a tree mixing tensors and
            other objects.
        ValueError: for a 0-dim leaf, a list whose length is not this rank's batch size, or
            results passed by a rank whose pass has ended.
        RuntimeError: before the loader has yielded a batch, when its last pass was left
            before its end (the batch then came from another loader, or from no current pass),
            or when the collective fails.

    Example:

    >>> from accel import gather_for_metrics, RunContext, shard_loader
    >>> from torch.utils.data import DataLoader
    >>> ctx = RunContext.single()
    >>> loader = shard_loader(ctx, DataLoader(list(range(5)), batch_size=2))
    >>> [gather_for_metrics(ctx, b * 10, loader=loader).tolist() for b in loader]
    [[0, 10], [20, 30], [40]]
    >>> [gather_for_metrics(ctx, [f"s{i}" for i in b.tolist()], loader=loader) for b in loader]
    [['s0', 's1'], ['s2', 's3'], ['s4']]
    """
    fn = "gather_for_metrics"
    if not isinstance(loader, ShardedLoader):
        raise TypeError(
            f"{fn}: loader={type(loader).__name__} is not a ShardedLoader; pass "
            "the loader returned by shard_loader, which knows which samples are repeats."
        )
    if loader.pass_left:  # on every rank alike, so before any collective
        raise RuntimeError(
            f"{fn}: loader=ShardedLoader over {type(loader.dataset).__name__} left its pass "
            "before its end (a loop over it ended with break), so the batch being gathered was "
            "not yielded by its current pass and its layout does not apply; pass loader= the "
            "ShardedLoader the loop iterates (e.g. loader=eval_loader), inside that loop."
        )
    if ctx.sp_size > 1 and not loader.pass_ended:
        tree = _join_sequence(ctx, tree)
    ctx = along(ctx, "dp")  # tensor-, context- and sequence-parallel peers hold the same samples
    if loader.pass_ended:  # past this rank's last batch: others are in a round it has no part in
        return _join_without_batch(ctx, tree, loader)
    layout = loader.layout
    if not layout:
        raise RuntimeError(
            f"{fn}: the loader has not yielded a batch yet; call it inside the "
            "loop over the loader, after each batch."
        )
    mine, pad = layout[loader.plan.rank]  # the plan holds this rank's data-parallel place
    leaves, treedef = flatten(tree)
    if isinstance(tree, list) and not all(isinstance(x, torch.Tensor) for x in leaves):
        if len(tree) != mine:  # a list of Python objects, one per sample (decoded text)
            raise ValueError(
                f"{fn}: the list of objects has {len(tree)} items but the batch has {mine} "
                "samples; pass one item per sample of the batch (e.g. one decoded string each)."
            )
        real = list(tree[: mine - pad])
        return real if loader.plan.world_size == 1 else gather_parts(ctx, real, None)
    if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        raise TypeError(
            f"{fn}: tree={type(tree).__name__} mixes tensors and other objects; pass a nest of "
            "tensors (batch on dim 0), or a list with one Python object per sample, e.g. "
            "list(zip(predictions, references)) for pairs of decoded strings."
        )
    for leaf in leaves:
        if leaf.ndim == 0:
            raise ValueError(
                f"{fn}: a leaf of shape () has no dim 0 to hold one row per sample of the batch "
                f"of {mine}; pass per-sample rows, e.g. loss.repeat(batch_size) as Accelerate's "
                "scripts do, or gather a per-batch value with accel.gather(ctx, value[None])."
            )
    per_sample = all(leaf.shape[0] == mine for leaf in leaves)
    keep = _round_samples(loader.plan, layout)
    if loader.plan.world_size == 1:
        if per_sample:
            return unflatten(treedef, [leaf[: mine - pad] for leaf in leaves])
        return unflatten(treedef, [leaf[:keep] for leaf in leaves])
    if any(size != layout[0][0] for size, _ in layout):  # an uneven round; some may have none
        part = (per_sample, treedef, leaves, mine - pad, keep)
        return _gather_uneven(ctx, part, leaves[0].device if leaves else None)
    if per_sample:
        return _gather_padded(ctx, leaves, treedef, layout)
    hint = "Every rank must pass leaves of the same structure, dtypes and shapes."
    everyone = gather_leaves(ctx, fn, leaves, treedef, hint)  # shapes agree, so does per_sample
    return unflatten(treedef, [g[:keep] for g in everyone])


def _join_sequence(ctx: RunContext, tree: Any) -> Any:
    """Sequence-parallel peers' slices joined back into whole sequences: every tensor of 2+
    dims (what `shard_loader` cut along dim 1) is gathered over sp and joined along dim 1."""
    leaves, treedef = flatten(tree)
    if not leaves or not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        return tree  # Python objects per sample: the sp peers hold the same samples
    sp = along(ctx, "sp")
    cut = [i for i, leaf in enumerate(leaves) if leaf.dim() >= 2]
    joined = gather(sp, [leaves[i].transpose(0, 1).contiguous() for i in cut])
    for i, whole in zip(cut, joined, strict=True):
        leaves[i] = whole.transpose(0, 1)
    return unflatten(treedef, leaves)


def _round_samples(plan: ShardPlan, layout: Layout) -> int | None:
    """How many real samples the round holds when it is short of a full step (the last round),
    Accelerate's `remainder`; None for a full round, or when steps vary in size."""
    real = sum(size - pad for size, pad in layout)
    full = plan.step_samples
    return real if full is not None and real < full else None


def _gather_uneven(ctx: RunContext, part: Any, device: torch.device | None) -> Any:
    """A round whose batches differ in size (even_batches=False, or ranks past their last batch,
    which pass None): every rank's rows through one object exchange. Per-sample leaves go
    without their repeats; if any rank's leaves are not per-sample (`loss.repeat(n)`),
    everything is concatenated in rank order and cut to the round's real samples (Accelerate's
    rule). Lists of Python objects from the other ranks are joined as `gather_parts` joins."""
    if part is not None:
        per_sample, treedef, leaves, real, keep = part
        leaves = [leaf[:real].cpu() if per_sample else leaf.cpu() for leaf in leaves]
        part = (per_sample, treedef, leaves, keep)
    parts = [p for p in gather_object(ctx, part) if p is not None]
    if not parts:
        return []
    if isinstance(parts[0], list):  # the others gathered decoded objects
        return [item for p in parts for item in p]
    _, treedef, _, keep = parts[0]
    cut = None if all(p[0] for p in parts) else keep
    to = device if device is not None else torch.device("cpu")
    return unflatten(
        treedef,
        [torch.cat([p[2][i] for p in parts])[:cut].to(to) for i in range(len(parts[0][2]))],
    )


def _gather_padded(ctx: RunContext, leaves: list[Any], treedef: Any, layout: Layout) -> Any:
    """Gather a round of equal batches in one checked exchange (padded to the longest should
    they differ), then keep each rank's real samples."""
    longest = max(size for size, _ in layout)
    padded = [pad_tensor(leaf, 0, longest, 0, False) for leaf in leaves]
    hint = (
        "Every rank must pass per-sample results of the same structure, dtypes and trailing shape."
    )
    everyone = gather_leaves(ctx, "gather_for_metrics", padded, treedef, hint)
    if all(size - pad == longest for size, pad in layout):  # nothing to drop: no copy
        return unflatten(treedef, everyone)
    out = [
        torch.cat(
            [g[r * longest : r * longest + size - pad] for r, (size, pad) in enumerate(layout)]
        )
        for g in everyone
    ]
    return unflatten(treedef, out)


def _join_without_batch(ctx: RunContext, tree: Any, loader: ShardedLoader) -> Any:
    """Take part in a round this rank has no batch in: contribute nothing, get the others'."""
    leaves = flatten(tree)[0]
    passed = [x for x in leaves if not (isinstance(x, torch.Tensor) and x.ndim and not len(x))]
    out = _gather_uneven(ctx, None, loader.device) if loader.plan.world_size > 1 else []
    if passed:  # after the collective, so the other ranks are not left waiting
        raise ValueError(
            "gather_for_metrics: this rank's loop over the loader has ended, so it has no batch "
            "in this round, but it passed results; a rank past its last batch contributes "
            "nothing: call gather_for_metrics(ctx, [], loader=loader)."
        )
    return out
