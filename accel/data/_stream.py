"""Iterable datasets split across ranks and DataLoader workers, aligned at the end, resumable.

One of the `BatchSource`s of `accel.data._source` (`open_stream` picks it). A stream that can split
itself is cut into world_size * num_workers parts; the DataLoader worker `w` of rank `r` reads
only part `r * num_workers + w` and batches it. Datasets split themselves in one of three ways:

- a Hugging Face `datasets.IterableDataset`: `split_dataset_by_node(ds, rank, world_size)` (by
  shards when `num_shards % world_size == 0`, else every world_size-th example), and then the
  dataset itself hands its shards to the DataLoader workers, as `datasets` does;
- the accel protocol `iter_shard(num_shards, index) -> Iterator`: the samples of part `index`;
- a `shard(num_shards, index)` method returning an iterable of that part.

Batches of a rank come from its workers in a fixed round-robin (worker 0, 1, ... skipping
workers that have finished), so the order depends only on (seed, epoch, world size, workers).
Every step, the ranks exchange their batch sizes (one small all_gather): when one rank's part
ends first, the others stop at the same step, or, with even_batches, it yields its first batch
again marked as padding until every rank has finished. The position of every worker is kept as
of the last batch yielded: the dataset's own `state_dict()` when it has one (resumed without
re-reading), else the number of samples read (re-read and skipped on resume).
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from accel._groups import comm_device, named_collective, require_group
from accel.collectives import broadcast_object
from accel.context import RunContext
from accel.data._shard_plan import ShardPlan
from accel.data._source import Layout, WholeStream, pass_generator, plan_line, unknown_length
from accel.data._stream_dispatch import DispatchStream
from accel.data._workers import worker_options

SplitKind = Literal["datasets", "iter_shard", "shard"]
DISPATCH_NEEDS_STREAM = (
    "shard_loader: dispatch_batches=True works for iterable datasets without split_batches; "
    "got {name} with split_batches={split}. Map-style datasets are read without duplication "
    "already: drop dispatch_batches (or split_batches)."
)
# One worker's position as of the last batch this rank yielded from it: samples read, whether
# its part has ended, and the dataset's own state when it has one.
WorkerState = dict[str, Any]


def is_hf_iterable(dataset: object) -> bool:
    """Whether `dataset` is a Hugging Face `datasets.IterableDataset` (without importing it)."""
    module = sys.modules.get("datasets")
    return module is not None and isinstance(dataset, module.IterableDataset)


def split_kind(dataset: object) -> tuple[SplitKind | None, str]:
    """How `dataset` splits itself across (rank, worker), and why, for `describe()`."""
    name = type(dataset).__name__
    if is_hf_iterable(dataset):
        return "datasets", (
            "datasets.IterableDataset: split_dataset_by_node per rank (by shards when num_shards "
            "% world_size == 0, else by examples); its shards are then divided among workers"
        )
    if callable(getattr(dataset, "iter_shard", None)):
        return "iter_shard", f"{name}.iter_shard(num_shards, index) per (rank, worker)"
    if callable(getattr(dataset, "shard", None)):
        return "shard", f"{name}.shard(num_shards, index) per (rank, worker)"
    return None, (
        f"{name} has no iter_shard()/shard() method and is not a datasets.IterableDataset: "
        "every rank reads the whole stream in the main process and keeps its slice of each "
        "chunk (Accelerate's IterableDatasetShard layout)"
    )


def open_stream(
    ctx: RunContext, loader: DataLoader[Any], plan: ShardPlan, dispatch: bool
) -> SplitStream | DispatchStream | WholeStream:
    """The source of an iterable dataset: split, dispatched, or read whole by every rank."""
    if dispatch:
        return DispatchStream(ctx, loader, plan)
    kind, reason = split_kind(loader.dataset)
    if kind == "datasets":
        reason += _datasets_split(loader.dataset, plan)
    if kind is None and loader.num_workers > 0:
        warnings.warn(
            f"shard_loader: num_workers={loader.num_workers} is not used: {reason}. Give the "
            "dataset an iter_shard(num_shards, index) or shard(num_shards, index) method so "
            "each worker reads its own part, or pass dispatch_batches=True to read it with "
            "workers on rank 0.",
            stacklevel=4,
        )
    if kind is None:
        return WholeStream(loader, plan, reason)
    return SplitStream(ctx, loader, plan, kind, reason)


def _datasets_split(dataset: Any, plan: ShardPlan) -> str:
    """Which way split_dataset_by_node takes here, or that the user has split it already."""
    # `_distributed` is where datasets records a split_dataset_by_node call (no public name).
    done = getattr(dataset, "_distributed", None)
    if done is not None:
        if (done.rank, done.world_size) != (plan.rank, plan.world_size):
            raise ValueError(
                f"shard_loader: the datasets stream was split for rank={done.rank}, "
                f"world_size={done.world_size} (split_dataset_by_node) but this is rank "
                f"{plan.rank} of {plan.world_size}. Pass the unsplit dataset: shard_loader "
                "splits it for each rank itself."
            )
        return (
            f"; already split by split_dataset_by_node(rank={done.rank}, world_size="
            f"{done.world_size}): used as this rank's part, not split again"
        )
    num_shards = int(getattr(dataset, "num_shards", 0))
    if num_shards % plan.world_size == 0:
        return f"; here by shards: {num_shards} shards over {plan.world_size} ranks"
    return (
        f"; here by examples: {num_shards} shards do not divide among {plan.world_size} "
        "ranks, so every rank decodes every example and keeps its own"
    )


def _stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


class _CountedBatch:
    """A batch collated in a worker with its sample count and the worker's position after it."""

    __slots__ = ("batch", "num_samples", "state", "worker")

    def __init__(self, worker: int, num_samples: int, batch: Any, state: WorkerState) -> None:
        self.worker, self.num_samples, self.batch, self.state = worker, num_samples, batch, state


class _PartReader(IterableDataset[_CountedBatch]):
    """What each DataLoader worker runs: read this (rank, worker)'s part and batch it.

    Holds plain values only (rank and world size, never a context), since it is pickled into
    the workers. The last item of every worker has `batch=None` and marks its part's end.
    """

    def __init__(
        self,
        dataset: Any,
        kind: SplitKind,
        *,
        rank: int,
        world_size: int,
        batch_size: int,
        drop_last: bool,
        collate_fn: Callable[[list[Any]], Any],
        resume: list[WorkerState | None] | None,
    ) -> None:
        self.dataset, self.kind = dataset, kind
        self.rank, self.world_size = rank, world_size
        self.batch_size, self.drop_last, self.collate_fn = batch_size, drop_last, collate_fn
        self.resume = resume

    def _open(self, worker: int, num_workers: int, start: WorkerState | None) -> tuple[Any, Any]:
        """(iterable of the part's samples, the object holding its state or None)."""
        num_parts, index = self.world_size * num_workers, self.rank * num_workers + worker
        if self.kind == "shard":
            part = self.dataset.shard(num_parts, index)
        elif self.kind == "datasets":
            # Split by node already; it divides its shards among workers itself. A copy, so the
            # state loaded for this pass does not stay on the loader's own dataset (read in
            # this process when num_workers=0) and resume a later, fresh pass. Deep: its
            # shallow copy shares the original's __dict__.
            part = copy.deepcopy(self.dataset)
        else:
            part = self.dataset
        holder = part if _stateful(part) else None
        if holder is not None and start is not None and start.get("dataset") is not None:
            holder.load_state_dict(start["dataset"])
        if self.kind == "iter_shard":
            return self.dataset.iter_shard(num_parts, index), holder
        return part, holder

    def __iter__(self) -> Iterator[_CountedBatch]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        start = self.resume[worker] if self.resume is not None else None
        read = int(start["samples"]) if start is not None else 0
        if start is not None and start["done"]:
            yield _CountedBatch(worker, 0, None, dict(start))
            return
        source, holder = self._open(worker, num_workers, start)
        skip = read if holder is None else 0  # no state of its own: re-read up to the position

        def position(done: bool) -> WorkerState:
            state = holder.state_dict() if holder is not None else None
            return {"samples": read, "done": done, "dataset": state}

        batch: list[Any] = []
        for sample in source:
            if skip:
                skip -= 1
                continue
            batch.append(sample)
            read += 1
            if len(batch) == self.batch_size:
                yield _CountedBatch(worker, len(batch), self.collate_fn(batch), position(False))
                batch = []
        if batch and not self.drop_last:
            yield _CountedBatch(worker, len(batch), self.collate_fn(batch), position(False))
        yield _CountedBatch(worker, 0, None, position(True))


class SplitStream:
    """This rank's position in a split stream: one per `ShardedLoader`, mutated as it yields."""

    ends_at_count = False  # how many batches each rank gets is known only at the end
    state_is_per_rank = True  # every rank (and worker) has its own place in its own part

    def __init__(
        self,
        ctx: RunContext,
        loader: DataLoader[Any],
        plan: ShardPlan,
        kind: SplitKind,
        reason: str,
    ) -> None:
        dataset: Any = loader.dataset
        if kind == "datasets" and getattr(dataset, "_distributed", None) is None:
            # Imported here: `datasets` is optional and only present when the user has it.
            from datasets.distributed import split_dataset_by_node

            dataset = split_dataset_by_node(dataset, rank=plan.rank, world_size=plan.world_size)
        assert loader.batch_size is not None  # checked by shard_loader
        self._ctx, self.loader, self.plan, self.kind = ctx, loader, plan, kind
        self.reason = reason
        self.dataset = dataset
        size = loader.batch_size
        self.batch_size = size // plan.world_size if plan.split_batches else size
        self.num_workers = max(1, loader.num_workers)
        self.workers: list[WorkerState | None] | None = None
        self.cursor = 0  # the worker whose batch comes next
        self.pad_batch: Any = None  # yielded again as padding once this rank's part has ended
        self.pad_size = 0
        self.layout: Layout = ()
        self._warned = False
        self._persistent: DataLoader[Any] | None = None  # reused when persistent_workers

    def describe(self) -> str:
        return (
            f"{plan_line(self.plan)}\nsplit stream, {self.num_workers} worker(s) per rank: "
            f"{self.reason}"
        )

    def num_batches(self, epoch: int, *, seed: int) -> int:
        raise unknown_length(self.reason)

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any] | None:
        return {
            "rank": self.plan.rank,
            "kind": self.kind,
            "num_workers": self.num_workers,
            "cursor": self.cursor,
            "workers": self.workers,
            "pad_batch": self.pad_batch,
            "pad_size": self.pad_size,
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is None:
            raise ValueError(
                "ShardedLoader.load_state_dict: the state has no 'stream' entry, so it was not "
                "saved by a loader over this split stream; save it with state_dict() of a "
                "loader built the same way."
            )
        if state.get("rank") != self.plan.rank:
            raise ValueError(
                f"ShardedLoader.load_state_dict: this stream position was saved by rank "
                f"{state.get('rank')!r} but this is rank {self.plan.rank}; every rank reads its "
                "own part of a split stream, so each needs its own position. save_state/"
                "load_state keep each rank's own; with state_dict() directly, load each rank's."
            )
        if state.get("num_workers") != self.num_workers:
            raise ValueError(
                f"ShardedLoader.load_state_dict: the stream position was saved with "
                f"num_workers={state.get('num_workers')!r} (at least 1) but this loader has "
                f"{self.num_workers}; each worker reads its own part of the stream, so a "
                "position only means the same samples with the same number of workers. Resume "
                "with the original num_workers, or start the epoch afresh with set_epoch()."
            )
        self.cursor, self.workers = int(state["cursor"]), state["workers"]
        self.pad_batch, self.pad_size = state["pad_batch"], int(state["pad_size"])

    # -- iteration ---------------------------------------------------------------------------

    def iterate(self, epoch: int, *, seed: int, position: int) -> Iterator[Any]:
        """This rank's batches of `epoch`, from the saved position when `position > 0`."""
        generator = pass_generator(self.loader, seed, epoch, self.plan.rank)
        if position == 0:
            self.workers, self.cursor, self.pad_batch, self.pad_size = None, 0, None, 0
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        self._warn_reread()
        return self._aligned(self._local(generator))

    def _warn_reread(self) -> None:
        if self.workers is None or self._warned:
            return
        total = sum(
            int(w["samples"]) for w in self.workers if w is not None and w["dataset"] is None
        )
        if total:
            self._warned = True
            warnings.warn(
                f"shard_loader: {type(self.loader.dataset).__name__} has no state_dict()/"
                f"load_state_dict(), so resuming re-reads and skips the {total} samples this "
                "rank's workers had read. Give the dataset state_dict()/load_state_dict() to "
                "resume without re-reading.",
                stacklevel=4,
            )

    def _inner_loader(self, generator: torch.Generator) -> DataLoader[Any]:
        """The DataLoader over the workers' parts; with persistent_workers, one for all epochs.

        A resumed pass gets a loader of its own: its workers start from the saved positions,
        which persistent workers would carry into the next epoch.
        """
        loader = self.loader
        persistent = loader.persistent_workers and self.workers is None
        if persistent and self._persistent is not None:
            return self._persistent
        reader = _PartReader(
            self.dataset,
            self.kind,
            rank=self.plan.rank,
            world_size=self.plan.world_size,
            batch_size=self.batch_size,
            drop_last=loader.drop_last,
            collate_fn=loader.collate_fn,
            resume=self.workers,
        )
        inner = DataLoader(
            reader,
            batch_size=None,
            persistent_workers=persistent,
            **worker_options(loader, generator),
        )
        if persistent:
            self._persistent = inner
        return inner

    def _local(self, generator: torch.Generator) -> Iterator[tuple[int, Any]]:
        """(size, batch) of this rank, from its workers in round-robin order."""
        num = self.num_workers
        states: list[WorkerState | None] = list(self.workers or [None] * num)
        done = [s is not None and bool(s["done"]) for s in states]
        if all(done):
            return
        buffers: list[deque[_CountedBatch]] = [deque() for _ in range(num)]
        items = iter(self._inner_loader(generator))
        w = self.cursor
        while not all(done):
            if done[w]:
                w = (w + 1) % num
                continue
            while not buffers[w]:  # the DataLoader interleaves workers itself; reorder
                item = next(items)
                buffers[item.worker].append(item)
            item = buffers[w].popleft()
            states[w] = item.state
            self.workers = list(states)
            if item.batch is None:
                done[w] = True
                continue
            w = (w + 1) % num
            self.cursor = w
            yield item.num_samples, item.batch

    def _aligned(self, local: Iterator[tuple[int, Any]]) -> Iterator[Any]:
        """Every rank takes a step only while every rank has a batch (or pads with one)."""
        pad = self.plan.even_batches and not self.plan.drop_last
        while True:
            size, batch = next(local, (0, None))
            if batch is not None and self.pad_batch is None:
                self.pad_batch, self.pad_size = batch, size
            sizes = self._exchange(size, self.pad_size if self.pad_batch is not None else -1)
            if all(s == 0 for s, _ in sizes):
                return
            if any(s == 0 for s, _ in sizes):
                if not pad:
                    return  # stop at the same step everywhere
                sizes = self._lend_padding(sizes)
                if batch is None:
                    batch, size = self.pad_batch, self.pad_size
            self.layout = tuple((s, 0) if s else (p, p) for s, p in sizes)
            yield batch

    def _lend_padding(self, sizes: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Give a rank that has finished without a single batch the first batch of another."""
        if all(p >= 0 for s, p in sizes if s == 0):
            return sizes
        lender = next(r for r, (_, p) in enumerate(sizes) if p >= 0)
        self.pad_batch = broadcast_object(self._ctx, self.pad_batch, src=lender)
        self.pad_size = sizes[lender][1]
        return [(s, p if p >= 0 else sizes[lender][1]) for s, p in sizes]

    def _exchange(self, size: int, pad_size: int) -> list[tuple[int, int]]:
        """(batch size, padding batch size or -1) of every rank for this step."""
        if self.plan.world_size == 1:
            return [(size, pad_size)]
        # self._ctx is the data-parallel context (shard_loader passes along(ctx, "dp")), whose
        # ranks are the plan's.
        group = require_group(self._ctx, "shard_loader")
        mine = torch.tensor([size, pad_size], dtype=torch.int64, device=comm_device(self._ctx))
        everyone = [torch.empty_like(mine) for _ in range(self.plan.world_size)]
        with named_collective(self._ctx, "shard_loader (aligning the ranks' streams)"):
            dist.all_gather(everyone, mine, group=group)
        return [(s, p) for s, p in torch.stack(everyone).tolist()]  # one copy to the host
