"""Iteration speed of shard_loader against the plain DataLoader it wraps (one process).

Both iterate the same map-style dataset with the same batch size and shuffling; epochs alternate
between the two so drift in the machine's speed hits both alike. Reports median epoch times.

    python benchmarks/loader.py            # full run
    python benchmarks/loader.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.data import DataLoader, Dataset

import accel


class Features(Dataset[tuple[torch.Tensor, int]]):
    """An in-memory dataset with a small per-sample cost, like a decoded and cached corpus."""

    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], i % 10


def _epoch_seconds(loader: object) -> float:
    start = time.perf_counter()
    for _ in loader:  # type: ignore[attr-defined]
        pass
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n, epochs = (5_000, 5) if args.quick else (50_000, 15)
    ctx = accel.RunContext.single()
    data = Features(n)
    print(f"torch {torch.__version__}, {n} samples, batch 32, shuffle, {epochs} epochs each")
    print("| workers | DataLoader (ms/epoch) | shard_loader (ms/epoch) | throughput ratio |")
    print("|---|---|---|---|")
    for workers in (0, 2):
        plain = DataLoader(data, batch_size=32, shuffle=True, num_workers=workers)
        sharded = accel.shard_loader(
            ctx, DataLoader(data, batch_size=32, shuffle=True, num_workers=workers)
        )
        _epoch_seconds(plain), _epoch_seconds(sharded)  # warm up
        times: dict[str, list[float]] = {"plain": [], "sharded": []}
        for _ in range(epochs):
            times["plain"].append(_epoch_seconds(plain))
            times["sharded"].append(_epoch_seconds(sharded))
        p, s = statistics.median(times["plain"]), statistics.median(times["sharded"])
        print(f"| {workers} | {p * 1e3:.1f} | {s * 1e3:.1f} | {p / s:.3f} |")
    print("target: throughput ratio >= 0.98")


if __name__ == "__main__":
    main()
