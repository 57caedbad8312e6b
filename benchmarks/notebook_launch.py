"""Start-up time of `accel.notebook_launch` against `accel.testing.run_world`, 2 processes.

    python benchmarks/notebook_launch.py [--runs 11]

Each run starts a two-process world that meets once (a barrier over gloo) and returns; it is
timed from the call to its return, in this process (torch already imported, as in a notebook
kernel). notebook_launch forks, run_world spawns fresh interpreters that import torch and
accel; both use the same store, deadline and error machinery. Runs alternate so load on the
machine hits both alike; the table gives medians. Target: notebook_launch within 1.2x of
run_world.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import accel
from accel.testing import run_world


def meet(ctx: accel.RunContext) -> int:
    accel.wait_for_everyone(ctx)
    return ctx.rank


def ddp_step(ctx: accel.RunContext) -> int:
    model = accel.wrap_model(ctx, torch.nn.Linear(8, 8))
    model(torch.ones(4, 8)).sum().backward()
    return ctx.rank


def _time(start: Callable[[], Any]) -> float:
    begin = time.perf_counter()
    assert start() == [0, 1]
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=11)
    runs = parser.parse_args().runs
    starts: dict[str, Callable[[], Any]] = {
        "run_world (spawn)": lambda: run_world(meet, world_size=2, timeout=300),
        "notebook_launch (fork)": lambda: accel.notebook_launch(
            meet, num_processes=2, device="cpu", timeout=300
        ),
        "notebook_launch, DDP step (fork)": lambda: accel.notebook_launch(
            ddp_step, num_processes=2, device="cpu", timeout=300
        ),
    }
    first = _time(starts["notebook_launch, DDP step (fork)"])
    print(f"first DDP launch in this process: {first:.3f} s (imports torch._dynamo once)\n")
    times: dict[str, list[float]] = {name: [] for name in starts}
    for r in range(runs):
        order = list(starts) if r % 2 == 0 else list(reversed(starts))
        for name in order:
            times[name].append(_time(starts[name]))
    base = statistics.median(times["run_world (spawn)"])
    print("| start | median s | vs run_world |")
    print("|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.3f} | {median / base:.3f}x |")


if __name__ == "__main__":
    main()
