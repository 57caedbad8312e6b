"""`accel.gather` against a bare `all_gather_into_tensor` at 2 ranks over gloo (CPU).

    python benchmarks/collectives.py [--iters 200]

Both calls run interleaved in the same processes on the same tensors; the table gives the
median time per call and the ratio. accel's gather adds one 8-byte all-gather that checks
every rank passed the same shapes and dtypes (so a mismatch raises instead of hanging).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from accel import RunContext, gather
from accel.testing import run_world

_bare = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
SIZES = (1_024, 65_536, 1_048_576, 4_194_304)  # float32 elements per rank


def _bench(ctx: RunContext, iters: int) -> list[tuple[int, float, float]]:
    rows = []
    for numel in SIZES:
        x = torch.randn(numel)
        out = torch.empty(ctx.world_size * numel)
        n = max(10, iters * 65_536 // max(numel, 65_536))
        for _ in range(5):  # warm-up
            gather(ctx, x)
            _bare(out, x)
        accel_t, bare_t = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            gather(ctx, x)
            t1 = time.perf_counter()
            _bare(out, x)
            t2 = time.perf_counter()
            accel_t.append(t1 - t0)
            bare_t.append(t2 - t1)
        rows.append((numel, statistics.median(accel_t), statistics.median(bare_t)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=200)
    iters = parser.parse_args().iters
    rows: Any = run_world(_bench, world_size=2, args=(iters,), timeout=600)[0]
    print(
        "| elements per rank | MB per rank | accel.gather (us) "
        "| all_gather_into_tensor (us) | ratio |"
    )
    print("|---|---|---|---|---|")
    for numel, accel_s, bare_s in rows:
        print(f"| {numel:,} | {numel * 4 / 1e6:.2f} | {accel_s * 1e6:.0f} | {bare_s * 1e6:.0f} "
              f"| {accel_s / bare_s:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
