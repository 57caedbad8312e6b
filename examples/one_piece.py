"""An existing hand-written DDP loop that takes only data sharding and metric gathering from accel.

Process-group set-up, DDP, the optimizer and the loop are plain PyTorch; accel contributes
`shard_loader` (each rank reads its part, the same shuffle on every rank, evened-out last batch)
and `gather_for_metrics` (every evaluation sample counted exactly once), given a `RunContext`
value built from what torch.distributed already knows.

    accel launch --num_processes 2 examples/one_piece.py
    torchrun --nproc_per_node 2 examples/one_piece.py
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from accel import RunContext, gather_for_metrics, shard_loader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    # The user's own set-up, as it was before accel.
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    ctx = RunContext(
        rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world
    )

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 8, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()  # a separable two-class problem
    train = shard_loader(
        ctx, DataLoader(TensorDataset(x[:800], y[:800]), batch_size=32, shuffle=True)
    )
    test = shard_loader(ctx, DataLoader(TensorDataset(x[800:], y[800:]), batch_size=64))

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    for epoch in range(args.epochs):
        train.set_epoch(epoch)
        for xb, yb in train:
            loss = F.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        correct = []
        with torch.no_grad():
            for xb, yb in test:
                both = gather_for_metrics(ctx, (model(xb).argmax(-1), yb), loader=test)
                correct.append(both[0] == both[1])
        seen = torch.cat(correct)
        if rank == 0:
            print(f"epoch {epoch} accuracy {seen.float().mean().item():.3f} on {len(seen)} samples")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
