"""The sources behind `ShardedLoader`: one protocol, and the two sources read in this process.

A source yields this rank's batches of one epoch from a position, says how many there are,
holds any state of its own and describes itself; the loader keeps the epoch, the position, the
resume and the device placement. The four sources:

- `MapSource`: map-style datasets, by `ShardPlan` (Accelerate's `BatchSamplerShard` layout);
  only this rank's indices are read, by a DataLoader with the user's workers;
- `WholeStream`: an iterable dataset that cannot split itself, read whole by every rank, which
  keeps its slice of each chunk (Accelerate's `IterableDatasetShard` layout);
- `accel.data._stream.SplitStream`: an iterable dataset split across (rank, worker);
- `accel.data._stream_dispatch.DispatchStream`: rank 0 reads the stream and sends the batches.

Which rank pads the last round (the one answer for every source): padding exists only with
`even_batches` (and not `drop_last`) on several ranks, always sits at the END of a batch, and
`ShardedLoader.padding` / `layout` count it. Where a round is dealt out in rank order (map-style,
whole and dispatched streams), the ranks after the last real sample of the epoch pad: the rank
holding the last real sample completes its batch with repeats, and every higher rank's batch is
all repeats (samples, or whole batches, from the start of the epoch); lower ranks never pad. A
split stream has no rank order: every rank whose own part has ended pads, with its first batch
of the epoch again (all repeats), for as long as another rank still has real batches.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import BatchSampler, DataLoader

from accel.data._shard_plan import (
    ShardBatch,
    ShardPlan,
    epoch_generator,
    is_torch_kind,
    sampler_indices,
)
from accel.data._workers import worker_options

# Layout of the batch index each rank was given last: (size, padding) per data-parallel rank.
Layout = tuple[tuple[int, int], ...]


class BatchSource(Protocol):
    """What `ShardedLoader` reads its batches from (one class per way of reading a dataset)."""

    @property
    def layout(self) -> Layout:
        """(size, padding) on every rank of the batch this source yielded last; () before."""
        ...

    @property
    def ends_at_count(self) -> bool:
        """True when a pass yields exactly `num_batches(...)` batches, so the loader knows the
        pass is complete at its last batch (not only when asked for one more)."""
        ...

    @property
    def state_is_per_rank(self) -> bool:
        """True when `state_dict()` differs from rank to rank (saved per rank)."""
        ...

    def num_batches(self, epoch: int, *, seed: int) -> int:
        """Batches this rank yields in `epoch`; TypeError when only the end of a stream tells."""
        ...

    def iterate(self, epoch: int, *, seed: int, position: int) -> Iterator[Any]:
        """This rank's batches of `epoch`, skipping the first `position` of them."""
        ...

    def state_dict(self) -> dict[str, Any] | None:
        """The source's own position (None: the loader's position is all, at any world size)."""
        ...

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Continue from a `state_dict()` of the same kind of source."""
        ...

    def describe(self) -> str:
        """The lines of `ShardedLoader.describe()`: layout settings, how the data is read."""
        ...


def plan_line(plan: ShardPlan) -> str:
    """The first line of every source's `describe()`: the layout settings."""
    return (
        f"rank {plan.rank} of {plan.world_size}, batch_size={plan.batch_size}, even_batches="
        f"{plan.even_batches}, split_batches={plan.split_batches}, drop_last={plan.drop_last}"
    )


def unknown_length(reason: str) -> TypeError:
    """The error of `len()` on a stream whose length per rank is known only at its end."""
    return TypeError(
        f"len(ShardedLoader): {reason}; how many batches each rank gets depends on how the "
        "stream splits, which is known only at its end."
    )


def pass_generator(loader: DataLoader[Any], seed: int, epoch: int, rank: int) -> torch.Generator:
    """The generator that seeds a pass's workers: the user's, else one from (seed, epoch, rank).

    Starting a DataLoader iterator draws its workers' base seed from its generator, which is
    torch's global RNG when none is given: a resumed run would start its iterator at a point the
    uninterrupted one did not and shift the dropout masks of every later step. Drawn from
    (seed, epoch, rank) instead, workers also get the same seeds after a resume.
    """
    generator = loader.generator
    return epoch_generator(seed, epoch, rank) if generator is None else generator


class _PositionOnly:
    """A source whose state is the loader's position alone (it can move to another world size)."""

    state_is_per_rank = False

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        return None


class MapSource(_PositionOnly):
    """A map-style dataset by `ShardPlan`: only this rank's indices are read."""

    ends_at_count = True

    def __init__(self, loader: DataLoader[Any], plan: ShardPlan) -> None:
        self.loader, self.plan = loader, plan
        # The epoch's plan for every rank, by (epoch, seed), and the index yielded last in it.
        self._table: tuple[tuple[int, int], list[list[ShardBatch]]] | None = None
        self._yielded: tuple[list[list[ShardBatch]], int] | None = None

    def _underlying_batches(self, epoch: int, seed: int) -> list[list[int]]:
        loader = self.loader
        batch_sampler = loader.batch_sampler
        if batch_sampler is None:  # batch_size=None: every sample is its own "batch"
            return [[i] for i in sampler_indices(loader.sampler, epoch, seed)]
        if is_torch_kind(batch_sampler, BatchSampler):
            indices = sampler_indices(batch_sampler.sampler, epoch, seed)
            size = batch_sampler.batch_size
            batches = [indices[i : i + size] for i in range(0, len(indices), size)]
            if batch_sampler.drop_last and batches and len(batches[-1]) < size:
                batches.pop()
            return batches
        if hasattr(batch_sampler, "set_epoch"):
            batch_sampler.set_epoch(epoch)
        return [[int(i) for i in b] for b in batch_sampler]

    def _all_ranks(self, epoch: int, seed: int) -> list[list[ShardBatch]]:
        if self._table is None or self._table[0] != (epoch, seed):
            batches = self._underlying_batches(epoch, seed)
            plans = [self.plan.for_rank(r).shard(batches) for r in range(self.plan.world_size)]
            self._table = ((epoch, seed), plans)
        return self._table[1]

    def num_batches(self, epoch: int, *, seed: int) -> int:
        return len(self._all_ranks(epoch, seed)[self.plan.rank])

    def iterate(self, epoch: int, *, seed: int, position: int) -> Iterator[Any]:
        table = self._all_ranks(epoch, seed)
        mine = table[self.plan.rank]
        if position >= len(mine):
            return
        loader = self.loader
        generator = pass_generator(loader, seed, epoch, self.plan.rank)
        common = worker_options(loader, generator) | {"collate_fn": loader.collate_fn}
        if loader.batch_sampler is None:
            inner = DataLoader(
                loader.dataset,
                batch_size=None,
                sampler=[b.indices[0] for b in mine[position:]],
                **common,
            )
        else:
            inner = DataLoader(
                loader.dataset, batch_sampler=[list(b.indices) for b in mine[position:]], **common
            )
        for i, batch in enumerate(inner, position):
            self._yielded = (table, i)  # the layout is worked out only when someone asks for it
            yield batch

    @property
    def layout(self) -> Layout:
        if self._yielded is None:
            return ()
        table, i = self._yielded
        return tuple((len(p[i].indices), p[i].padding) if i < len(p) else (0, 0) for p in table)

    def describe(self) -> str:
        return f"{plan_line(self.plan)}\nmap-style {type(self.loader.dataset).__name__}"


class WholeStream(_PositionOnly):
    """An iterable dataset that cannot split itself: every rank reads it whole in this process
    and keeps its slice of each chunk of world_size * batch_size samples (Accelerate's layout).
    """

    # Its count comes from the dataset's __len__, a promise the stream itself may not keep.
    ends_at_count = False

    def __init__(self, loader: DataLoader[Any], plan: ShardPlan, reason: str) -> None:
        self.loader, self.plan, self.reason = loader, plan, reason
        self.layout: Layout = ()

    def _chunk_size(self) -> int:
        size = self.loader.batch_size
        if size is None:
            raise ValueError(
                "shard_loader: an iterable dataset needs a DataLoader with a batch_size; the "
                "stream is cut into chunks of world_size * batch_size."
            )
        return size if self.plan.split_batches else size * self.plan.world_size

    def num_batches(self, epoch: int, *, seed: int) -> int:
        n = len(self.loader.dataset)  # type: ignore[arg-type]
        per_chunk = self._chunk_size()
        return n // per_chunk if self.plan.drop_last else math.ceil(n / per_chunk)

    def iterate(self, epoch: int, *, seed: int, position: int) -> Iterator[Any]:
        per_chunk = self._chunk_size()
        collate = self.loader.collate_fn
        n = self.plan.world_size
        first: list[Any] | None = None
        chunk: list[Any] = []
        index = 0
        if position:  # a stream cannot seek: re-read up to the position
            warn_reread(self.loader.dataset, position * per_chunk)

        def emit(chunk: list[Any], num_real: int) -> Any:
            layout = tuple(self.plan.for_rank(r).iterable_slice(chunk, num_real) for r in range(n))
            self.layout = tuple((len(part), pad) for part, pad in layout)
            return collate(layout[self.plan.rank][0])

        for element in self.loader.dataset:  # type: ignore[attr-defined]
            chunk.append(element)
            if len(chunk) < per_chunk:
                continue
            if first is None:
                first = list(chunk)
            if index >= position:  # resumed runs re-read the stream up to their position
                yield emit(chunk, per_chunk)
            index += 1
            chunk = []
        if chunk and not self.plan.drop_last:
            num_real = len(chunk)
            cycle = first if first is not None else list(chunk)
            while n > 1 and len(chunk) < per_chunk:  # one process: the short batch as it is
                chunk += cycle
            if index >= position:
                yield emit(chunk[:per_chunk], num_real)

    def describe(self) -> str:
        return f"{plan_line(self.plan)}\n{self.reason}"


def warn_reread(dataset: object, num_samples: int) -> None:
    """Warn that resuming a stream that cannot split re-reads `num_samples` samples."""
    warnings.warn(
        f"shard_loader: resuming re-reads the first {num_samples} samples of "
        f"{type(dataset).__name__} on every rank to reach the saved position (a stream that "
        "does not split itself cannot seek). Give it iter_shard()/shard() and state_dict()/"
        "load_state_dict() to resume from its own state.",
        stacklevel=4,
    )
