"""Per-step cost of accel's training-step calls against the same loop written by hand.

A small MLP (hidden 256, batch 32) on CPU, one process. Blocks of steps alternate between the
two loops so drift in the machine's speed hits both alike; the table reports medians.

    python benchmarks/step_overhead.py            # full run
    python benchmarks/step_overhead.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import accel


def _setup() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, torch.randn(32, 256), torch.randint(0, 10, (32,))


def _by_hand(steps: int) -> Callable[[], None]:
    model, opt, x, y = _setup()

    def run() -> None:
        for _ in range(steps):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()

    return run


def _with_accel(steps: int) -> Callable[[], None]:
    ctx = accel.RunContext.single()
    model, opt, x, y = _setup()
    model = accel.wrap_model(ctx, model)
    scaler = accel.make_scaler(ctx)

    def run() -> None:
        for step in range(steps):
            with accel.accumulate(ctx, model, step) as sync:
                with accel.autocast(ctx):
                    loss = F.cross_entropy(model(x), y)
                accel.scaled_backward(ctx, loss, scaler=scaler)
            if sync:
                accel.optimizer_step(ctx, opt, scaler=scaler)
                opt.zero_grad()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer, shorter blocks")
    args = parser.parse_args()
    blocks, steps = (10, 50) if args.quick else (40, 200)
    torch.set_num_threads(1)  # one core: the comparison is about Python overhead, not BLAS
    loops = {"by hand": _by_hand(steps), "accel": _with_accel(steps)}
    for run in loops.values():
        run()  # warm up
    times: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(blocks):
        for name, run in loops.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) / steps * 1e6)
    hand, acc = (statistics.median(times[n]) for n in ("by hand", "accel"))
    print(f"torch {torch.__version__}, {blocks} blocks of {steps} steps, 1 thread")
    print("| loop | median us/step | ratio |")
    print("|---|---|---|")
    print(f"| by hand | {hand:.1f} | 1.000 |")
    print(f"| accel | {acc:.1f} | {acc / hand:.3f} |")
    print(f"target: within 2% -> {'met' if acc / hand <= 1.02 else 'MISSED'}")
    # The same medians as throughput: each of the 32 samples is one "token" through the MLP.
    per_sample = accel.num_flops_per_token(sum(p.numel() for p in _setup()[0].parameters()))
    for name, us in (("by hand", hand), ("accel", acc)):
        rate = accel.throughput_metrics(
            step_time_s=us / 1e6, num_tokens=32, flops_per_token=per_sample
        )
        print(f"{name}: {rate['tokens_per_s']:.0f} samples/s, {rate['tflops_per_s']:.4f} TFLOP/s")


if __name__ == "__main__":
    main()
