"""What a logging call costs on a rank that does not write, against the step it sits in.

`log_metrics` on rank 1 returns before reading its metrics (no `.item()`, so no device sync),
whatever trackers `init_trackers` built. This times, per call: an empty Python function (the
floor), `log_metrics` on rank 1 with the stand-ins `init_trackers` gives every tracker there,
and `log_metrics` on rank 0 into a JSONL file (for scale), next to one training step of a small
MLP (hidden 256, batch 32, CPU). Medians of several blocks.

    python benchmarks/tracking.py            # full run
    python benchmarks/tracking.py --quick    # a second or so
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import accel

MAIN = accel.RunContext(rank=0, world_size=2)
OTHER = accel.RunContext(rank=1, world_size=2)


def _per_call(fn: Callable[[], None], calls: int, blocks: int) -> float:
    times = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def _train_step() -> Callable[[], None]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 256), torch.randint(0, 10, (32,))

    def step() -> None:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    quick = parser.parse_args().quick
    calls, blocks = (2_000, 3) if quick else (50_000, 9)
    loss = torch.tensor(0.5)
    names = ["jsonl", "tensorboard", "wandb", "mlflow", "trackio"]
    folder = tempfile.mkdtemp()
    stand_ins = accel.init_trackers(OTHER, names, project="bench", directory=folder)
    (jsonl,) = accel.init_trackers(MAIN, ["jsonl"], project="bench", directory=folder)

    def nothing() -> None:
        pass

    def off_main() -> None:
        accel.log_metrics(OTHER, {"loss": loss, "lr": 0.1}, step=1, trackers=stand_ins)

    def on_main() -> None:
        accel.log_metrics(MAIN, {"loss": loss, "lr": 0.1}, step=1, trackers=[jsonl])

    rows = [
        ("empty Python function", _per_call(nothing, calls, blocks)),
        ("log_metrics on rank 1, 5 trackers", _per_call(off_main, calls, blocks)),
        ("log_metrics on rank 0, JSONL file", _per_call(on_main, calls // 10, blocks)),
        ("one training step (MLP, CPU)", _per_call(_train_step(), calls // 100, blocks)),
    ]
    jsonl.close()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("| call | per call |\n|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1e6:.2f} us |")


if __name__ == "__main__":
    main()
