"""Which indices each rank reads: the epoch's sample order, then pure arithmetic over its batches.

The order of a shuffling loader is Accelerate's seedable rule (`sampler_indices`): a
`torch.Generator` seeded with `seed + epoch`, identical on every rank.

The layout is the one Hugging Face Accelerate's `BatchSamplerShard` and `IterableDatasetShard`
produce, so a migrating user sees the same samples on the same ranks:

- one process: the batches as they are (Accelerate does not shard then), nothing padded;
- batch k of the underlying batch sampler goes to rank k mod n;
- `split_batches`: every batch is cut into n equal slices, slice r to rank r;
- `drop_last` (the DataLoader's, or a batch sampler's own `drop_last` attribute): the last,
  incomplete round is dropped, so every rank has the same number of batches;
- `even_batches` (and not `drop_last`): the last round is completed with samples cycled from the
  start of the epoch, so every rank gets the same number of batches of the same size. Those
  samples are padding: `ShardBatch.padding` counts them (they always sit at the batch's end),
  and `gather_for_metrics` drops them. Batches of variable size (a batch sampler without a
  batch size, which Accelerate refuses with even_batches) are completed with whole batches
  from the start of the epoch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard, TypeVar

import torch
from torch.utils.data import RandomSampler, SequentialSampler
from typing_extensions import Self

from accel.context import RunContext

__all__ = ["ShardBatch", "ShardPlan"]


@dataclass(frozen=True, slots=True)
class ShardBatch:
    """The dataset indices of one batch of one rank; the last `padding` of them are repeats."""

    indices: tuple[int, ...]
    padding: int = 0

    @property
    def num_real(self) -> int:
        return len(self.indices) - self.padding


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardPlan:
    """Per-rank sharding of an epoch's batches, computable on any rank for every rank.

    `batch_size` is the underlying loader's batch size (None for batch samplers of variable size);
    with `split_batches` it is the global batch size and each rank gets `batch_size // world_size`.

    Example:

    >>> from accel import ShardPlan
    >>> plan = ShardPlan(rank=1, world_size=2, batch_size=2)
    >>> [b.indices for b in plan.shard([[0, 1], [2, 3], [4, 5], [6]])]
    [(2, 3), (6, 0)]
    >>> plan.shard([[0, 1], [2, 3], [4, 5], [6]])[-1].padding
    1
    """

    rank: int
    world_size: int
    batch_size: int | None
    split_batches: bool = False
    even_batches: bool = True
    drop_last: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"ShardPlan: rank={self.rank} must be in [0, world_size={self.world_size})."
            )
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"ShardPlan: batch_size={self.batch_size} must be >= 1 or None.")
        if self.split_batches:
            if self.batch_size is None:
                raise ValueError(
                    "split_batches=True needs a loader with a batch size: each batch is cut into "
                    "world_size equal slices. Give the DataLoader batch_size=..., or use "
                    "split_batches=False."
                )
            if self.batch_size % self.world_size:
                raise ValueError(
                    f"split_batches=True: the batch size {self.batch_size} is not divisible by "
                    f"the world size {self.world_size}; use a batch size that is a multiple of "
                    f"{self.world_size}, or split_batches=False."
                )

    @classmethod
    def for_context(
        cls,
        ctx: RunContext,
        *,
        batch_size: int | None,
        split_batches: bool = False,
        even_batches: bool = True,
        drop_last: bool = False,
    ) -> Self:
        """The plan for `ctx`'s data-parallel rank and size (tensor-parallel peers share it).

        Example:

        >>> ShardPlan.for_context(RunContext(rank=1, world_size=2), batch_size=4).rank
        1
        """
        return cls(
            rank=ctx.dp_rank,
            world_size=ctx.dp_size,
            batch_size=batch_size,
            split_batches=split_batches,
            even_batches=even_batches,
            drop_last=drop_last,
        )

    @property
    def rank_batch_size(self) -> int | None:
        """Samples each rank takes per step: `batch_size`, or its share with `split_batches`."""
        if self.batch_size is None or not self.split_batches:
            return self.batch_size
        return self.batch_size // self.world_size

    @property
    def step_samples(self) -> int | None:
        """Samples of the epoch all ranks take together per step (None: batches vary)."""
        per_rank = self.rank_batch_size
        return None if per_rank is None else per_rank * self.world_size

    def samples_before(self, position: int) -> int | None:
        """Samples of the epoch taken once every rank has yielded `position` batches.

        Example:

        >>> ShardPlan(rank=0, world_size=4, batch_size=2).samples_before(3)
        24
        """
        step = self.step_samples
        return None if step is None else position * step

    def for_rank(self, rank: int) -> ShardPlan:
        """The same plan seen from another rank."""
        return dataclasses.replace(self, rank=rank)

    def shard(self, batches: Sequence[Sequence[int]]) -> list[ShardBatch]:
        """This rank's batches, given every underlying batch of the epoch in order."""
        if self.world_size == 1:  # Accelerate does not shard for one process: nothing is padded
            return [ShardBatch(tuple(b)) for b in batches]
        if self.split_batches:
            return self._split(batches)
        return self._round_robin(batches)

    def _round_robin(self, batches: Sequence[Sequence[int]]) -> list[ShardBatch]:
        n, r, size = self.world_size, self.rank, self.batch_size
        out = [
            ShardBatch(tuple(batches[k]))
            for k in range(r, len(batches), n)
            # a round is yielded only when complete (and, with a fixed batch size, when its last
            # batch is full); what remains is handled below
            if (k // n + 1) * n <= len(batches)
            and (size is None or len(batches[(k // n + 1) * n - 1]) == size)
        ]
        done_rounds = len(out)
        if self.drop_last or not batches:
            return out
        tail = list(batches[done_rounds * n :])
        if not tail:
            return out
        if not self.even_batches:
            if r < len(tail):
                out.append(ShardBatch(tuple(tail[r])))
            return out
        if size is None:  # variable-size batches: lend whole batches from the start of the epoch
            lent = [batches[i % len(batches)] for i in range(n - len(tail))]
            entries = [ShardBatch(tuple(b)) for b in tail] + [
                ShardBatch(tuple(b), len(b)) for b in lent
            ]
            out.append(entries[r])
            return out
        start = [i for b in batches[:n] for i in b]
        while len(start) < n * size:
            start += start
        cursor = 0
        for k in range(n):
            batch = list(tail[k]) if k < len(tail) else []
            need = size - len(batch)
            pad = start[cursor : cursor + need]
            cursor += need
            if k == r:
                out.append(ShardBatch(tuple(batch + pad), len(pad)))
        return out

    def _split(self, batches: Sequence[Sequence[int]]) -> list[ShardBatch]:
        assert self.batch_size is not None  # checked in __post_init__
        per = self.batch_size // self.world_size
        lo, hi = per * self.rank, per * (self.rank + 1)
        out = [ShardBatch(tuple(b[lo:hi])) for b in batches if len(b) == self.batch_size]
        if self.drop_last or not batches or len(batches[-1]) == self.batch_size:
            return out
        last = list(batches[-1])
        if not self.even_batches:
            if len(last) > lo:
                out.append(ShardBatch(tuple(last[lo:hi])))
            return out
        start = list(batches[0])
        while len(start) < self.batch_size:
            start += start
        full = last + start
        real = max(0, min(per, len(last) - lo))
        out.append(ShardBatch(tuple(full[lo:hi]), per - real))
        return out

    def iterable_slice(self, chunk: Sequence[object], num_real: int) -> tuple[list[object], int]:
        """This rank's part of one chunk of an iterable dataset, and how much of it is padding.

        A chunk holds `world_size * batch_size` elements (or `batch_size` with split_batches),
        of which the first `num_real` are real; the rest were cycled from the first chunk.
        """
        assert self.batch_size is not None  # iterable datasets are batched by the loader
        per = self.batch_size // self.world_size if self.split_batches else self.batch_size
        lo = per * self.rank
        part = list(chunk[lo : lo + per])
        real = max(0, min(len(part), num_real - lo))
        return part, len(part) - real


def epoch_generator(*parts: int) -> torch.Generator:
    """A generator seeded from `parts` (seed, epoch, rank), the same on every call."""
    value = 0
    for part in parts:
        value = value * 1_000_003 + part
    # Folded into 64 bits: manual_seed refuses larger integers, which large seeds would reach.
    return torch.Generator().manual_seed(value % 2**64)


def _shuffle_generator(seed: int, epoch: int) -> torch.Generator:
    """Accelerate's SeedableRandomSampler: a generator seeded with seed + epoch.

    So `seed=s` gives the order of Accelerate's `use_seedable_sampler=True` run after
    `set_seed(s)` (or with `data_seed=s`), epoch by epoch.
    """
    return torch.Generator().manual_seed((seed + epoch) % 2**64)


# torchdata's StatefulDataLoader builds its own RandomSampler and BatchSampler in place of
# torch's: the same samples, plus state. Its RandomSampler seeds itself from torch's global RNG
# when it has no generator (a different order on every rank and in a resumed run), so both are
# read as torch's are: the order from (seed, epoch), the position from the ShardedLoader.
_TORCHDATA_SAMPLERS = "torchdata.stateful_dataloader.sampler"
_T = TypeVar("_T")


def is_torch_kind(obj: object, cls: type[_T]) -> TypeGuard[_T]:
    """`obj` is exactly a `cls` (torch's sampler class), or torchdata's stateful twin of it."""
    kind = type(obj)
    return kind is cls or (kind.__module__ == _TORCHDATA_SAMPLERS and kind.__name__ == cls.__name__)


def sampler_indices(sampler: Any, epoch: int, seed: int) -> list[int]:
    """The sampler's indices for `epoch`, identical on every rank."""
    if is_torch_kind(sampler, RandomSampler):
        # Same permutation on every rank from (seed, epoch): no RNG state to broadcast.
        n = len(sampler.data_source)
        if not sampler.replacement and sampler.num_samples == n:
            # What RandomSampler yields with this generator, without its per-element generator.
            return torch.randperm(n, generator=_shuffle_generator(seed, epoch)).tolist()
        seeded = RandomSampler(
            sampler.data_source,
            replacement=sampler.replacement,
            num_samples=sampler._num_samples,
            generator=_shuffle_generator(seed, epoch),
        )
        return list(seeded)
    if type(sampler) is SequentialSampler:
        return list(range(len(sampler.data_source)))
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    return [int(i) for i in sampler]
