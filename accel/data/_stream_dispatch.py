"""Dispatch mode for iterable datasets: rank 0 reads the stream and sends each rank its batch.

Part of the data concern (`accel.data._stream.open_stream` chooses it for
`shard_loader(..., dispatch_batches=True)`): the Accelerate `dispatch_batches` behaviour for
streams that cannot split themselves.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from accel._groups import global_rank, named_collective, require_group
from accel.context import RunContext
from accel.data._shard_plan import ShardPlan
from accel.data._source import Layout, pass_generator, plan_line, unknown_length
from accel.data._workers import worker_options


class _Counted:
    """A collate_fn that also returns how many samples it batched (picklable for workers)."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples: list[Any]) -> tuple[int, Any]:
        return len(samples), self.collate_fn(samples)


class DispatchStream:
    """Rank 0 reads the stream (with the loader's workers) and sends each rank its batch.

    For streams that cannot split themselves: batch k goes to rank k mod world_size, as in the
    round-robin layout. Batches travel pickled with their shapes, so variable-length batches
    need no padding. The last round is completed with the epoch's first batches (padding)
    with even_batches, else every rank stops before it. A resume re-reads on rank 0.
    """

    ends_at_count = False  # rank 0 learns the number of rounds only at the stream's end
    state_is_per_rank = False

    def __init__(self, ctx: RunContext, loader: DataLoader[Any], plan: ShardPlan) -> None:
        self._ctx, self.loader, self.plan = ctx, loader, plan
        self.num_workers = max(1, loader.num_workers)
        self.layout: Layout = ()
        self._warned = False
        self.reason = (
            f"dispatch_batches=True: rank 0 reads the whole {type(loader.dataset).__name__} "
            "and sends every rank its batch, shapes included"
        )

    def describe(self) -> str:
        return f"{plan_line(self.plan)}\n{self.reason}"

    def num_batches(self, epoch: int, *, seed: int) -> int:
        raise unknown_length(self.reason)

    def state_dict(self) -> dict[str, Any] | None:
        # The position (rounds yielded) is the loader's own; the kind guards a mixed-up resume.
        return {"kind": "dispatch"}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is None or state.get("kind") != "dispatch":
            raise ValueError(
                "ShardedLoader.load_state_dict: the state was not saved by a loader with "
                "dispatch_batches=True; resume with the loader settings it was saved with."
            )

    def iterate(self, epoch: int, *, seed: int, position: int) -> Iterator[Any]:
        dataset: Any = self.loader.dataset
        generator = pass_generator(self.loader, seed, epoch, self.plan.rank)
        if self.plan.rank != 0:
            return self._receive(None)
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        if position and not self._warned:
            self._warned = True
            warnings.warn(
                f"shard_loader: dispatch_batches=True resumes by re-reading {position} rounds "
                f"of {self.plan.world_size} batches on rank 0 (a dispatched stream has no "
                "per-rank state). Split the stream instead (iter_shard/shard) to resume "
                "without re-reading.",
                stacklevel=3,
            )
        return self._receive(itertools.islice(self._rounds(generator), position, None))

    def _rounds(self, generator: torch.Generator) -> Iterator[list[tuple[int, int, Any]]]:
        """Rank 0: (size, padding, batch) for every rank, one list per step."""
        loader, n = self.loader, self.plan.world_size
        inner = DataLoader(
            loader.dataset,
            batch_size=loader.batch_size,
            drop_last=loader.drop_last,
            collate_fn=_Counted(loader.collate_fn),
            **worker_options(loader, generator),
        )
        batches, first = iter(inner), list[tuple[int, Any]]()
        pad = self.plan.even_batches and not self.plan.drop_last
        while True:
            step = list(itertools.islice(batches, n))
            first += step[: n - len(first)]
            if len(step) == n:
                yield [(size, 0, batch) for size, batch in step]
                continue
            if step and pad:
                lent = [first[i % len(first)] for i in range(n - len(step))]
                yield [(s, 0, b) for s, b in step] + [(s, s, b) for s, b in lent]
            return

    def _receive(self, steps: Iterator[list[tuple[int, int, Any]]] | None) -> Iterator[Any]:
        n = self.plan.world_size
        while True:
            step = next(steps, None) if steps is not None else None
            if n == 1:
                mine: Any = (step[0][2], ((step[0][0], step[0][1]),)) if step else None
            else:
                layout = tuple((s, p) for s, p, _ in step) if step else ()
                sent = [(step[r][2], layout) if step else None for r in range(n)]
                got: list[Any] = [None]
                group = require_group(self._ctx, "shard_loader")
                with named_collective(self._ctx, "shard_loader (dispatch_batches)"):
                    src = global_rank(self._ctx, 0)
                    dist.scatter_object_list(got, sent if steps is not None else None, src, group)
                mine = got[0]
            if mine is None:
                return
            batch, self.layout = mine
            yield batch
