"""Iterable datasets for the streaming tests, each logging every sample it reads to a folder.

Defined in a module of their own so spawned `run_world` ranks and DataLoader workers can import
them. Every read appends one line `<sample>` to `<folder>/reads-<pid>`, so a test can count how
often each sample was produced, across every process that read it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset, IterableDataset


def _log(folder: str | None, sample: int) -> None:
    if folder is not None:
        with open(Path(folder, f"reads-{os.getpid()}"), "a") as f:
            f.write(f"{sample}\n")


def reads(folder: str | Path) -> list[int]:
    """Every sample read by any process, with repeats."""
    return sorted(int(x) for p in Path(folder).glob("reads-*") for x in p.read_text().split())


class GenStream(IterableDataset[int]):
    """A generator dataset with the accel protocol `iter_shard` and its own state.

    Sample i belongs to part i % num_shards. `sizes`, when given, makes the parts uneven: part k
    of the stream holds only its first sizes[k] samples.
    """

    def __init__(self, n: int, folder: str | None = None, sizes: tuple[int, ...] = ()) -> None:
        self.n, self.folder, self.sizes = n, folder, sizes
        self.next: int | None = None  # the sample after the last one yielded (-1: finished)
        self._resume_at: int | None = None  # set by load_state_dict, used by one iter_shard

    def _part(self, num_shards: int, index: int) -> list[int]:
        part = list(range(index, self.n, num_shards))
        return part[: self.sizes[index]] if self.sizes else part

    def iter_shard(self, num_shards: int, index: int) -> Iterator[int]:
        part = self._part(num_shards, index)
        at, self._resume_at, self.next = self._resume_at, None, None
        start = 0 if at is None else part.index(at) if at in part else len(part)
        for i in part[start:]:
            self.next = i + num_shards
            _log(self.folder, i)
            yield i
        self.next = -1

    def __iter__(self) -> Iterator[int]:  # what every rank reads when nothing splits it
        for i in range(self.n):
            _log(self.folder, i)
            yield i

    def state_dict(self) -> dict[str, Any]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume_at = state["next"]


class ShardList(IterableDataset[int]):
    """A list with a `shard(num_shards, index)` method and no state of its own."""

    def __init__(self, items: list[int], folder: str | None = None) -> None:
        self.items, self.folder = items, folder

    def shard(self, num_shards: int, index: int) -> ShardList:
        return ShardList(self.items[index::num_shards], self.folder)

    def __iter__(self) -> Iterator[int]:
        for i in self.items:
            _log(self.folder, i)
            yield i


class PlainStream(IterableDataset[int]):
    """A stream that cannot split itself."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


def _mark_worker(folder: str) -> None:
    """Record that this process (a DataLoader worker) has started reading: `worker-<pid>`."""
    marker = Path(folder, f"worker-{os.getpid()}")
    if not marker.exists():
        marker.write_text(str(os.getppid()))


class EndlessStream(IterableDataset[int]):
    """A stream that splits itself and never ends; each worker marks its pid in `folder`."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def iter_shard(self, num_shards: int, index: int) -> Iterator[int]:
        _mark_worker(self.folder)
        i = index
        while True:
            yield i
            i += num_shards

    def __iter__(self) -> Iterator[int]:
        return self.iter_shard(1, 0)


class MarkedRange(Dataset[int]):
    """range(n) as a map-style dataset; each worker marks its pid in `folder`."""

    def __init__(self, n: int, folder: str) -> None:
        self.n, self.folder = n, folder

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        _mark_worker(self.folder)
        return index


def write_json_shards(folder: Path, sizes: list[int]) -> list[str]:
    """JSON-lines files holding ids 0..sum(sizes)-1, one file per size; returns the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths, start = [], 0
    for k, size in enumerate(sizes):
        path = folder / f"part-{k}.jsonl"
        path.write_text("".join(json.dumps({"id": i}) + "\n" for i in range(start, start + size)))
        paths.append(str(path))
        start += size
    return paths


def hf_stream(paths: list[str], cache: str) -> Any:
    """A `datasets` streaming dataset over local JSON files (no network)."""
    from datasets import load_dataset

    return load_dataset("json", data_files=paths, split="train", streaming=True, cache_dir=cache)


def ragged_collate(samples: list[int]) -> Any:
    """Sample i as a row of i % 4 + 1 copies of i, padded with -1 to the batch's longest row."""
    import torch

    width = max(i % 4 + 1 for i in samples)
    return torch.tensor([[i] * (i % 4 + 1) + [-1] * (width - i % 4 - 1) for i in samples])


def log_example(example: dict[str, Any], folder: str) -> dict[str, Any]:
    """A datasets `.map` function that logs each example it is given (i.e. each one read)."""
    _log(folder, int(example["id"]))
    return example


def torchdata_loader(kind: str, num_workers: int, n: int = 13) -> Any:
    """torchdata's real `StatefulDataLoader`, batch size 2: over a shuffled map-style list of
    `n` ints (kind "map") or over a `GenStream` of `n` (kind "stream")."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    if kind == "map":
        return StatefulDataLoader(
            list(range(n)), batch_size=2, shuffle=True, num_workers=num_workers
        )
    return StatefulDataLoader(GenStream(n), batch_size=2, num_workers=num_workers)
