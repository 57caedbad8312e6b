"""Streaming an iterable dataset at 2 ranks x 2 workers: samples decoded and throughput.

The same stream (N samples, each with a decode cost) is read three ways in one gloo world:

- split: accel's `shard_loader` over a dataset with `iter_shard`: each (rank, worker) decodes
  only its part of the stream;
- whole: the same samples from a dataset that cannot split itself, i.e. today's layout (and
  Accelerate's `IterableDatasetShard`): every rank decodes the whole stream in its main process
  and keeps its slice of each chunk;
- accelerate: `accelerate.data_loader.IterableDatasetShard`, when Accelerate is installed.

Rounds alternate the order of the variants, so drift in the machine's speed hits all alike.
Reported: decodes in total (every process counts its own), and epoch time (slowest rank) per
variant, best and median over the rounds, with throughput ratios to "whole".

    python benchmarks/stream.py                 # CPU-bound decode, 5 rounds
    python benchmarks/stream.py --cost io       # decode waits instead (remote reads)
    python benchmarks/stream.py --quick
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import accel
from accel.testing import run_world


def _decode(i: int, cost_s: float, kind: str) -> torch.Tensor:
    if kind == "io":
        time.sleep(cost_s)
    else:  # burn CPU for cost_s, as parsing or tokenising would
        end = time.thread_time() + cost_s
        while time.thread_time() < end:
            pass
    return torch.full((16,), float(i))


class _Counting:
    """Appends how many samples this process decoded to a file when its iteration ends."""

    folder: str

    def _count(self, n: int) -> None:
        with open(Path(self.folder, f"decoded-{os.getpid()}"), "a") as f:
            f.write(f"{n}\n")


class Split(IterableDataset[torch.Tensor], _Counting):
    def __init__(self, n: int, cost_s: float, kind: str, folder: str) -> None:
        self.n, self.cost_s, self.kind, self.folder = n, cost_s, kind, folder

    def iter_shard(self, num_shards: int, index: int) -> Iterator[torch.Tensor]:
        done = 0
        try:
            for i in range(index, self.n, num_shards):
                done += 1
                yield _decode(i, self.cost_s, self.kind)
        finally:
            self._count(done)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self.iter_shard(1, 0)


class Whole(IterableDataset[torch.Tensor], _Counting):
    """The same samples, with no way to split: read whole by every reader."""

    def __init__(self, n: int, cost_s: float, kind: str, folder: str) -> None:
        self.n, self.cost_s, self.kind, self.folder = n, cost_s, kind, folder

    def __iter__(self) -> Iterator[torch.Tensor]:
        done = 0
        try:
            for i in range(self.n):
                done += 1
                yield _decode(i, self.cost_s, self.kind)
        finally:
            self._count(done)


def _loader(ctx: accel.RunContext, variant: str, args: tuple[Any, ...]) -> Any:
    n, cost_s, kind, folder = args
    if variant == "split":
        return accel.shard_loader(
            ctx, DataLoader(Split(n, cost_s, kind, folder), batch_size=8, num_workers=2)
        )
    if variant == "whole":  # num_workers is not used by this layout: the main process reads
        return accel.shard_loader(
            ctx, DataLoader(Whole(n, cost_s, kind, folder), batch_size=8, num_workers=2)
        )
    from accelerate.data_loader import IterableDatasetShard  # optional, measured when present

    shard = IterableDatasetShard(
        Whole(n, cost_s, kind, folder),
        batch_size=8,
        num_processes=ctx.world_size,
        process_index=ctx.rank,
    )
    return DataLoader(shard, batch_size=8)  # workers would each read the whole stream again


def _world(ctx: accel.RunContext, variants: list[str], rounds: int, args: Any) -> Any:
    n, cost_s, kind, folder = args
    times: dict[str, list[float]] = {v: [] for v in variants}
    samples: dict[str, int] = {}
    for r in range(rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for variant in order:
            sub = f"{folder}/{variant}-{r}"
            if ctx.rank == 0:
                os.makedirs(sub)
            accel.wait_for_everyone(ctx)
            loader = _loader(ctx, variant, (n, cost_s, kind, sub))
            start = time.perf_counter()
            seen = sum(len(b) for b in loader)
            elapsed = time.perf_counter() - start
            accel.wait_for_everyone(ctx)
            slowest = accel.reduce(ctx, torch.tensor(elapsed), op="max")
            times[variant].append(float(slowest))
            samples[variant] = int(accel.reduce(ctx, torch.tensor(seen), op="sum"))
    return times, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cost", choices=["cpu", "io"], default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    n, rounds = (800, 2) if args.quick else (2000, args.rounds)
    cost_s = 0.0005
    variants = ["split", "whole"]
    if importlib.util.find_spec("accelerate") is not None:
        variants.append("accelerate")
    with tempfile.TemporaryDirectory() as folder:
        (times, samples), *_ = run_world(
            _world,
            world_size=2,
            timeout=1800,
            args=(variants, rounds, (n, cost_s, args.cost, folder)),
        )
        decoded = {
            v: [
                sum(
                    int(x)
                    for p in Path(folder).glob(f"{v}-{r}/decoded-*")
                    for x in p.read_text().split()
                )
                for r in range(rounds)
            ]
            for v in variants
        }
    print(
        f"torch {torch.__version__}, 2 ranks x 2 workers (gloo), {n} samples, batch 8, decode "
        f"{cost_s * 1e3:.1f} ms ({args.cost}), {rounds} rounds, {os.cpu_count()} CPUs"
    )
    if "accelerate" not in variants:
        print("accelerate is not installed: its IterableDatasetShard was not measured")
    print(
        "| layout | decoded / epoch | samples yielded | epoch s (best / median) | "
        "throughput vs whole (best / median) |"
    )
    print("|---|---|---|---|---|")
    base = times["whole"]
    for v in variants:
        t = times[v]
        ratios = [b / x for b, x in zip(base, t, strict=True)]
        print(
            f"| {v} | {max(decoded[v])} | {samples[v]} | {min(t):.3f} / "
            f"{statistics.median(t):.3f} | {max(ratios):.2f}x / {statistics.median(ratios):.2f}x |"
        )


if __name__ == "__main__":
    main()
