"""Shard a DataLoader across ranks, resume it mid-epoch, and gather evaluation results exactly.

`shard_loader(ctx, loader)` returns a `ShardedLoader` that iterates like the DataLoader but
yields only this rank's batches (the layout of `accel._shard_plan.ShardPlan`), shuffles the same
way on every rank with a different order every epoch, and records its position so
`state_dict()` / `load_state_dict()` resume exactly where a run stopped, without reading the
samples it skips. `gather_for_metrics` gathers per-sample results from all ranks and drops the
samples that were repeated to even out the last round.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from accel._shard_plan import ShardBatch, ShardPlan
from accel._tree import send_to_device, tensor_leaves, unflatten
from accel.collectives import _pad, gather_leaves
from accel.context import RunContext, along

__all__ = ["ShardBatch", "ShardPlan", "ShardedLoader", "gather_for_metrics", "shard_loader"]

# Layout of the last batch each rank was given: (size, padding) per rank.
Layout = tuple[tuple[int, int], ...]


def _epoch_generator(*parts: int) -> torch.Generator:
    """A generator seeded from `parts` (seed, epoch, ...), the same on every call."""
    value = 0
    for part in parts:
        value = value * 1_000_003 + part
    # Folded into 64 bits: manual_seed refuses larger integers, which large seeds would reach.
    return torch.Generator().manual_seed(value % 2**64)


def _sampler_indices(sampler: Any, epoch: int, seed: int) -> list[int]:
    """The sampler's indices for `epoch`, identical on every rank."""
    if type(sampler) is RandomSampler:
        # Same permutation on every rank from (seed, epoch): no RNG state to broadcast.
        n = len(sampler.data_source)
        if not sampler.replacement and sampler.num_samples == n:
            # What RandomSampler yields with this generator, without its per-element generator.
            return torch.randperm(n, generator=_epoch_generator(seed, epoch)).tolist()
        seeded = RandomSampler(
            sampler.data_source,
            replacement=sampler.replacement,
            num_samples=sampler._num_samples,
            generator=_epoch_generator(seed, epoch),
        )
        return list(seeded)
    if type(sampler) is SequentialSampler:
        return list(range(len(sampler.data_source)))
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    return [int(i) for i in sampler]


class ShardedLoader:
    """This rank's part of a DataLoader; iterate it like the DataLoader.

    It is training state, like an optimizer: it knows its epoch and how many batches it has
    yielded in it. `set_epoch(e)` chooses the epoch (the order is a function of seed and epoch);
    after a complete pass the epoch advances by itself. `padding` is how many samples of the
    batch just yielded repeat earlier ones (0 except in the last round with even_batches).
    """

    def __init__(
        self,
        ctx: RunContext,
        loader: DataLoader[Any],
        *,
        plan: ShardPlan,
        device_placement: bool,
        non_blocking: bool,
        seed: int,
    ) -> None:
        self._ctx = ctx
        self.loader = loader
        self.plan = plan
        # Batches come out of the DataLoader on the CPU: moving them there again is a no-op.
        self._device = ctx.device if device_placement and ctx.device.type != "cpu" else None
        self._non_blocking = non_blocking
        self._seed = seed
        self._iterable = isinstance(loader.dataset, IterableDataset)
        self.epoch = 0
        self.position = 0  # batches yielded in this epoch
        self._last_index = -1  # map-style: index of the last yielded batch in the epoch's plan
        self._chunk_layout: Layout = ()  # iterable: layout of the last yielded chunk
        self._table: tuple[int, list[list[ShardBatch]]] | None = None

    # -- the plan for an epoch ---------------------------------------------------------------

    def _underlying_batches(self, epoch: int) -> list[list[int]]:
        loader = self.loader
        batch_sampler = loader.batch_sampler
        if batch_sampler is None:  # batch_size=None: every sample is its own "batch"
            return [[i] for i in _sampler_indices(loader.sampler, epoch, self._seed)]
        if type(batch_sampler) is BatchSampler:
            indices = _sampler_indices(batch_sampler.sampler, epoch, self._seed)
            size = batch_sampler.batch_size
            batches = [indices[i : i + size] for i in range(0, len(indices), size)]
            if batch_sampler.drop_last and batches and len(batches[-1]) < size:
                batches.pop()
            return batches
        if hasattr(batch_sampler, "set_epoch"):
            batch_sampler.set_epoch(epoch)
        return [[int(i) for i in b] for b in batch_sampler]

    def _all_ranks(self, epoch: int) -> list[list[ShardBatch]]:
        if self._table is None or self._table[0] != epoch:
            batches = self._underlying_batches(epoch)
            plans = [self.plan.for_rank(r).shard(batches) for r in range(self.plan.world_size)]
            self._table = (epoch, plans)
        return self._table[1]

    # -- iteration ---------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` from its first batch at the next iteration."""
        if epoch < 0:
            raise ValueError(f"set_epoch: epoch={epoch} must be >= 0.")
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def __len__(self) -> int:
        if self._iterable:
            n = len(self.loader.dataset)  # type: ignore[arg-type]
            per_chunk = self._chunk_size()
            return n // per_chunk if self.plan.drop_last else math.ceil(n / per_chunk)
        return len(self._all_ranks(self.epoch)[self.plan.rank])

    def __iter__(self) -> Iterator[Any]:
        batches = self._iterate_iterable() if self._iterable else self._iterate_map()
        for batch in batches:
            self.position += 1
            if self._device is not None:
                batch = send_to_device(batch, self._device, non_blocking=self._non_blocking)
            yield batch
        self.epoch, self.position = self.epoch + 1, 0

    def _iterate_map(self) -> Iterator[Any]:
        table = self._all_ranks(self.epoch)
        mine = table[self.plan.rank]
        start = self.position
        if start >= len(mine):
            return
        loader = self.loader
        # Starting a DataLoader iterator draws its workers' base seed from `generator`, which
        # is torch's global RNG when none is given: a resumed run would start its iterator at a
        # point the uninterrupted one did not and shift the dropout masks of every later step.
        # Without the user's own generator, draw it from (seed, epoch, rank) instead, which
        # also gives workers the same seeds after a resume.
        generator = loader.generator
        if generator is None:
            generator = _epoch_generator(self._seed, self.epoch, self.plan.rank)
        common: dict[str, Any] = dict(
            generator=generator,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context,
        )
        if loader.num_workers > 0:
            common["prefetch_factor"] = loader.prefetch_factor
        if loader.batch_sampler is None:
            inner = DataLoader(
                loader.dataset,
                batch_size=None,
                sampler=[b.indices[0] for b in mine[start:]],
                **common,
            )
        else:
            inner = DataLoader(
                loader.dataset, batch_sampler=[list(b.indices) for b in mine[start:]], **common
            )
        for i, batch in enumerate(inner, start):
            self._last_index = i  # the layout is worked out only when someone asks for it
            yield batch

    def _chunk_size(self) -> int:
        size = self.loader.batch_size
        if size is None:
            raise ValueError(
                "shard_loader: an iterable dataset needs a DataLoader with a batch_size; the "
                "stream is cut into chunks of world_size * batch_size."
            )
        return size if self.plan.split_batches else size * self.plan.world_size

    def _iterate_iterable(self) -> Iterator[Any]:
        """Every rank reads the whole stream and keeps its slice of each chunk (in-process)."""
        per_chunk = self._chunk_size()
        collate = self.loader.collate_fn
        n = self.plan.world_size
        first: list[Any] | None = None
        chunk: list[Any] = []
        index = 0

        def emit(chunk: list[Any], num_real: int) -> Any:
            layout = tuple(self.plan.for_rank(r).iterable_slice(chunk, num_real) for r in range(n))
            self._chunk_layout = tuple((len(part), pad) for part, pad in layout)
            return collate(layout[self.plan.rank][0])

        for element in self.loader.dataset:  # type: ignore[attr-defined]
            chunk.append(element)
            if len(chunk) < per_chunk:
                continue
            if first is None:
                first = list(chunk)
            if index >= self.position:  # resumed runs re-read the stream up to their position
                yield emit(chunk, per_chunk)
            index += 1
            chunk = []
        if chunk and not self.plan.drop_last:
            num_real = len(chunk)
            cycle = first if first is not None else list(chunk)
            while len(chunk) < per_chunk:
                chunk += cycle
            if index >= self.position:
                yield emit(chunk[:per_chunk], num_real)

    @property
    def _layout(self) -> Layout:
        """(size, padding) on every rank of the batch index this loader yielded last."""
        if self._iterable:
            return self._chunk_layout
        if self._last_index < 0 or self._table is None:
            return ()
        i, table = self._last_index, self._table[1]
        return tuple((len(p[i].indices), p[i].padding) if i < len(p) else (0, 0) for p in table)

    @property
    def padding(self) -> int:
        """How many samples at the end of the last yielded batch repeat earlier ones."""
        layout = self._layout
        return layout[self.plan.rank][1] if layout else 0

    # -- checkpointing -----------------------------------------------------------------------

    def _dataset_length(self) -> int | None:
        try:
            return len(self.loader.dataset)  # type: ignore[arg-type]
        except TypeError:
            return None

    def state_dict(self) -> dict[str, Any]:
        """Epoch and position (plain ints), plus what a resumed run must match."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "world_size": self.plan.world_size,
            "dataset_length": self._dataset_length(),
            "seed": self._seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`: the next iteration yields the batch after the last one seen."""
        for key in ("world_size", "dataset_length"):
            mine = self.state_dict()[key]
            if state.get(key) != mine:
                raise ValueError(
                    f"ShardedLoader.load_state_dict: the state was saved with {key}="
                    f"{state.get(key)!r} but this loader has {key}={mine!r}; a position only "
                    "means the same batches with the same world size and dataset. Resume with "
                    "the original setting, or start the epoch afresh with set_epoch()."
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._seed = int(state.get("seed", self._seed))


def shard_loader(
    ctx: RunContext,
    loader: DataLoader[Any],
    *,
    even_batches: bool = True,
    split_batches: bool = False,
    device_placement: bool = True,
    non_blocking: bool = False,
    seed: int | None = None,
) -> ShardedLoader:
    """This rank's part of `loader`, as Accelerate's `prepare_data_loader` lays it out.

    Batch k of `loader` goes to rank k mod world_size (with `split_batches`, every batch is cut in
    world_size slices instead). With `even_batches` the last round is completed with samples from
    the start of the epoch so all ranks take the same number of steps; `gather_for_metrics` drops
    those repeats. A shuffling loader (`shuffle=True`) gets the same order on every rank, from
    `seed` (default `ctx.seed`, else 0) and the epoch. Batches are moved to `ctx.device` unless
    `device_placement=False`. Map-style datasets keep the loader's workers and pin_memory;
    iterable datasets are read in the main process by every rank, each keeping its slice.

    Example:

    >>> from torch.utils.data import DataLoader
    >>> ctx = RunContext(rank=1, world_size=2)
    >>> [b.tolist() for b in shard_loader(ctx, DataLoader(list(range(7)), batch_size=2))]
    [[2, 3], [6, 0]]
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"shard_loader: loader={type(loader).__name__} is not a torch DataLoader; wrap the "
            "dataset in torch.utils.data.DataLoader(dataset, batch_size=...)."
        )
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
        drop_last=loader.drop_last,
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
    )


def gather_for_metrics(ctx: RunContext, tree: Any, *, loader: ShardedLoader) -> Any:
    """Gather per-sample results of the batch `loader` just yielded; every sample counted once.

    Each leaf must have the batch on dim 0. Ranks' results are concatenated in rank order and
    the repeats `shard_loader` added to even out the last round are dropped; with
    `even_batches=False`, uneven last batches are padded for the collective and trimmed after.
    Call it on every rank for every batch (also if the loop breaks early: it uses the layout of
    the batch most recently yielded).

    Example:

    >>> from torch.utils.data import DataLoader
    >>> ctx = RunContext.single()
    >>> loader = shard_loader(ctx, DataLoader(list(range(5)), batch_size=2))
    >>> [gather_for_metrics(ctx, b * 10, loader=loader).tolist() for b in loader]
    [[0, 10], [20, 30], [40]]
    """
    if not isinstance(loader, ShardedLoader):
        raise TypeError(
            f"gather_for_metrics: loader={type(loader).__name__} is not a ShardedLoader; pass "
            "the loader returned by shard_loader, which knows which samples are repeats."
        )
    if not loader._layout:
        raise RuntimeError(
            "gather_for_metrics: the loader has not yielded a batch yet; call it inside the "
            "loop over the loader, after each batch."
        )
    ctx = along(ctx, "dp")  # tensor- and context-parallel peers hold the same samples
    leaves, treedef = tensor_leaves("gather_for_metrics", tree)
    layout = loader._layout
    mine = layout[ctx.rank][0]
    for leaf in leaves:
        if leaf.ndim == 0 or leaf.shape[0] != mine:
            raise ValueError(
                f"gather_for_metrics: a leaf of shape {tuple(leaf.shape)} has no per-sample "
                f"dim 0 of the batch size {mine}. Per-batch values (a mean loss) are not "
                "per-sample results: use accel.reduce(ctx, value, op='mean') for those."
            )
    if ctx.world_size == 1:
        real = mine - layout[0][1]
        return unflatten(treedef, [leaf[:real] for leaf in leaves])
    if any(size == 0 for size, _ in layout):
        empty = [r for r, (size, _) in enumerate(layout) if size == 0]
        raise RuntimeError(
            f"gather_for_metrics: ranks {empty} have no batch in this round (even_batches=False "
            "with fewer batches than ranks); they cannot join the collective. Use "
            "even_batches=True, or gather after the loop with accel.gather_object."
        )
    # Pad every rank's batch to the longest (even_batches=False), gather the whole tree in
    # one checked exchange, then keep each rank's real samples.
    longest = max(size for size, _ in layout)
    padded = [_pad(leaf, 0, longest, 0, False) for leaf in leaves]
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
