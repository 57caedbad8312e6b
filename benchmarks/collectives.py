"""`accel.gather` against a bare `all_gather_into_tensor` at 2 ranks over gloo (CPU).

    python benchmarks/collectives.py [--iters 200] [--quick]

Both run interleaved in the same processes on the same tensors; the table gives the median time
per call and the ratios. The hand-written baseline allocates its output, as gather must (it
returns a new tensor); a second column reuses one preallocated output, which a gather cannot do
(shown for honesty: at 4M elements the difference is the allocation and its page faults).
"tree" rows gather a (predictions, labels) pair, against two bare calls.

accel's gather always makes one extra check: every rank sends a hash of its shapes and dtypes
so a mismatch raises on every rank instead of hanging. Inputs that fit in the first round's
buffer (16 KiB per rank at 2 ranks) travel in that same collective, so small gathers cost one
collective; larger ones pay one small extra round before the data.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from accel import RunContext, gather, gather_for_metrics, shard_loader
from accel.testing import run_world

_bare = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
SIZES = (16, 1_024, 65_536, 1_048_576, 4_194_304)  # float32 elements per rank


def _hand_written(xs: tuple[torch.Tensor, ...], world_size: int) -> list[torch.Tensor]:
    outs = []
    for x in xs:
        out = x.new_empty((world_size * x.shape[0], *x.shape[1:]))
        _bare(out, x)
        outs.append(out)
    return outs


def _bare_reused(outs: list[torch.Tensor], xs: tuple[torch.Tensor, ...]) -> None:
    for out, x in zip(outs, xs, strict=True):
        _bare(out, x.reshape(-1))


def _medians_us(calls: list[Callable[[], object]], n: int) -> list[float]:
    """Median microseconds of each call, run interleaved n times after 5 warm-up rounds."""
    for _ in range(5):
        for call in calls:
            call()
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(n):
        for call, log in zip(calls, times, strict=True):
            start = time.perf_counter()
            call()
            log.append(time.perf_counter() - start)
    return [statistics.median(log) * 1e6 for log in times]


def _bench(ctx: RunContext, iters: int, sizes: tuple[int, ...]) -> list[tuple[Any, ...]]:
    rows = []
    cases: list[tuple[str, tuple[torch.Tensor, ...]]] = [
        (f"{numel:,}", (torch.randn(numel),)) for numel in sizes
    ]
    cases.append(("tree: 64x10 logits + 64 labels", (torch.randn(64, 10), torch.arange(64))))
    for label, xs in cases:
        numel = sum(x.numel() for x in xs)
        reused = [torch.empty(ctx.world_size * x.numel(), dtype=x.dtype) for x in xs]
        arg: Any = xs[0] if len(xs) == 1 else xs
        medians = _medians_us(
            [
                partial(gather, ctx, arg),
                partial(_hand_written, xs, ctx.world_size),
                partial(_bare_reused, reused, xs),
            ],
            max(10, iters * 65_536 // max(numel, 65_536)),
        )
        rows.append((label, numel * 4 / 1e6, *medians))
    rows += _bench_metrics(ctx, iters)
    return rows


def _bench_metrics(ctx: RunContext, iters: int) -> list[tuple[Any, ...]]:
    """`gather_for_metrics` on a batch of 64 predictions (DESIGN.md's 1.1x target).

    It goes through gather's checked exchange after padding uneven batches, and trims repeats
    after; here every rank's batch is full, so nothing is padded or trimmed.
    """
    from torch.utils.data import DataLoader

    loader = shard_loader(ctx, DataLoader(list(range(64 * 2 * 4)), batch_size=64))
    live = iter(loader)  # held: a pass whose iterator is dropped is no longer current
    next(live)  # the layout gather_for_metrics reads: 64 real samples on every rank
    rows = []
    cases: list[tuple[str, tuple[torch.Tensor, ...]]] = [
        ("gather_for_metrics: 64x10 logits", (torch.randn(64, 10),)),
        ("gather_for_metrics: 64x10 logits + 64 labels", (torch.randn(64, 10), torch.arange(64))),
    ]
    for label, xs in cases:
        arg: Any = xs[0] if len(xs) == 1 else xs
        medians = _medians_us(
            [
                partial(gather_for_metrics, ctx, arg, loader=loader),
                partial(_hand_written, xs, ctx.world_size),
            ],
            iters,
        )
        rows.append((label, sum(x.numel() for x in xs) * 4 / 1e6, *medians, None))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="fewer iterations and sizes")
    opts = parser.parse_args()
    iters, sizes = (30, SIZES[:3]) if opts.quick else (opts.iters, SIZES)
    rows: Any = run_world(_bench, world_size=2, args=(iters, sizes), timeout=600)[0]
    print(
        "| float32 elements per rank | MB per rank | accel.gather (us) | hand-written (us) "
        "| ratio | bare, reused output (us) | ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, mb, accel_us, bare_us, reuse_us in rows:
        reuse = "" if reuse_us is None else f"{reuse_us:.0f} | {accel_us / reuse_us:.2f}x"
        print(f"| {label} | {mb:.2f} | {accel_us:.0f} | {bare_us:.0f} | {accel_us / bare_us:.2f}x "
              f"| {reuse or ' | '} |")  # fmt: skip


if __name__ == "__main__":
    main()
