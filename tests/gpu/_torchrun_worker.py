"""Run under a one-process torchrun: init_distributed, a barrier and every collective on tensors
of the run's device, then write what it saw as JSON to argv[1]."""

from __future__ import annotations

import json
import sys

import torch

import accel


def main(out: str) -> None:
    # Asking for the backend gives the one-rank world a real group: NCCL on a GPU.
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    ctx = accel.init_distributed(seed=7, backend=backend)
    dev = ctx.device
    summed = torch.ones(4, device=dev)
    torch.distributed.all_reduce(summed)  # through the group itself, not accel's 1-rank shortcut
    x = torch.arange(6, dtype=torch.float32, device=dev).view(3, 2)
    tree = {"x": x, "ids": torch.tensor([4, 5], device=dev)}
    results = {
        "gather": accel.gather(ctx, tree),
        "reduce_mean": accel.reduce(ctx, x, op="mean"),
        "reduce_sum": accel.reduce(ctx, [x, x], op="sum"),
        "broadcast": accel.broadcast(ctx, tree),
        "pad": accel.pad_across_processes(ctx, x),
        "split": accel.split_between_processes(ctx, x),
    }
    accel.wait_for_everyone(ctx)
    leaves = [t for v in results.values() for t in _leaves(v)]
    seen = {
        "device": str(dev),
        "world_size": ctx.world_size,
        "backend": [ctx.backend, torch.distributed.get_backend()],
        "all_reduce": summed.cpu().tolist(),
        "describe": ctx.describe(),
        "leaf_devices": sorted({str(t.device) for t in leaves}),
        "values": {k: _plain(v) for k, v in results.items()},
        "gather_object": accel.gather_object(ctx, {"rank": ctx.rank}),
        "broadcast_object": accel.broadcast_object(ctx, [1, "two"]),
        "any_rank": [accel.any_rank(ctx, False), accel.any_rank(ctx, True)],
        "cuda_initialized": torch.cuda.is_initialized(),  # type: ignore[no-untyped-call]
    }
    accel.shutdown(ctx)
    with open(out, "w") as f:
        json.dump(seen, f)


def _leaves(tree: object) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _leaves(v)]
    return [t for v in tree for t in _leaves(v)]  # type: ignore[attr-defined]


def _plain(tree: object) -> object:
    if isinstance(tree, torch.Tensor):
        return tree.cpu().tolist()
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    return [_plain(v) for v in tree]  # type: ignore[attr-defined]


if __name__ == "__main__":
    main(sys.argv[1])
