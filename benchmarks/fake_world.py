"""What one rank pays to plan as the world grows: accel in a fake world of 8 to 8,192 ranks.

One process plays the last rank of a world of each size (torch's fake process group, fake
tensors: no data moves, no memory is taken by the model), on an N-D mesh (dp_replicate x
dp_shard=8 x tp=2, dp_replicate filling the rest; 8 ranks: dp_shard=4 x tp=2), and times
each planning step, with the peak of Python allocations (tracemalloc) beside it:

- init: the fake process group and the DeviceMesh (`with_mesh`, as init_distributed builds it);
- wrap: `wrap_model` of a 4-block Llama-style model (FSDP2 per block x tensor parallel);
- shard_loader: `ShardPlan`'s index plan of this rank's batches of a 1M-sample dataset;
- save plan: DCP's local save plan of this rank's sharded state dict;
- resume plan: DCP's local load plan of that state dict from a checkpoint saved at another
  world size (half as many ranks: every tensor in world/2 dim-0 chunks), as load_state at
  another world size makes it: the step that reads every saved chunk's metadata.

    python benchmarks/fake_world.py
"""

from __future__ import annotations

import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import accel
from accel import FSDPOptions, Parallelism, RunContext
from accel._mesh import with_mesh
from accel.estimate._fake import fake_tensors, fake_world
from tests.models import TP_PLAN, Block, Llama

WORLDS = (8, 64, 1024, 8192)


def mesh(world: int) -> Parallelism:
    if world == 8:
        return Parallelism(dp_shard=4, tp=2)
    return Parallelism(dp_replicate=world // 16, dp_shard=8, tp=2)


def measure(fn: Callable[[], Any]) -> tuple[Any, float, int]:
    tracemalloc.start()
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return result, seconds, peak


def saved_metadata(state: dict[str, Any], saved_world: int) -> Any:
    """DCP metadata of `state`'s tensors saved by `saved_world` ranks, each dim 0 in chunks."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    entries = {}
    for name, value in state.items():
        size = torch.Size(value.shape)
        rows = -(-size[0] // saved_world)
        chunks = [
            ChunkStorageMetadata(offsets=torch.Size([r * rows, *[0] * (len(size) - 1)]),
                                 sizes=torch.Size([min(rows, size[0] - r * rows), *size[1:]]))
            for r in range(saved_world) if r * rows < size[0]
        ]  # fmt: skip
        entries[name] = TensorStorageMetadata(
            properties=TensorProperties(dtype=value.dtype), size=size, chunks=chunks
        )
    return Metadata(state_dict_metadata=entries)


def one_world(world: int) -> dict[str, tuple[float, int]]:
    from torch.distributed.checkpoint.default_planner import (
        DefaultLoadPlanner,
        DefaultSavePlanner,
    )

    rank, figures = world - 1, {}  # type: ignore[var-annotated]
    with fake_world(rank, world), fake_tensors():
        ctx, s, m = measure(lambda: with_mesh(RunContext(rank=rank, world_size=world),
                                              mesh(world), source="benchmark"))  # fmt: skip
        figures["init"] = (s, m)
        model, s, m = measure(lambda: accel.wrap_model(
            ctx, Llama(vocab=1024, dim=256, heads=8, layers=4), tp_plan=TP_PLAN,
            fsdp=FSDPOptions(layer_classes=(Block,))))  # fmt: skip
        figures["wrap"] = (s, m)
        dp = ctx.dp_size
        batches = [list(range(i, i + 8 * dp)) for i in range(0, 1_000_000, 8 * dp)]
        plan = accel.ShardPlan(rank=ctx.dp_rank, world_size=dp, batch_size=8 * dp,
                               split_batches=True)  # fmt: skip
        _, s, m = measure(lambda: plan.shard(batches))
        figures["shard_loader"] = (s, m)
        state = model.state_dict()

        def save_plan() -> Any:
            planner = DefaultSavePlanner()
            planner.set_up_planner(state, is_coordinator=False)
            return planner.create_local_plan()

        _, s, m = measure(save_plan)
        figures["save plan"] = (s, m)
        metadata = saved_metadata(state, max(1, world // 2))

        def resume_plan() -> Any:
            planner = DefaultLoadPlanner()
            planner.set_up_planner(state, metadata=metadata, is_coordinator=False)
            return planner.create_local_plan()

        _, s, m = measure(resume_plan)
        figures["resume plan (from world/2)"] = (s, m)
    return figures


def main() -> None:
    results = {world: one_world(world) for world in WORLDS}
    steps = list(results[WORLDS[0]])
    print("| step | " + " | ".join(f"{w:,} ranks" for w in WORLDS) + f" | x from {WORLDS[0]} "
          f"to {WORLDS[-1]:,} ranks |")  # fmt: skip
    print("|---|" + "---|" * (len(WORLDS) + 1))
    for step in steps:
        cells = [f"{results[w][step][0] * 1e3:.1f} ms, {results[w][step][1] / 2**20:.2f} MiB"
                 for w in WORLDS]  # fmt: skip
        first, last = results[WORLDS[0]][step][0], results[WORLDS[-1]][step][0]
        print(f"| {step} | " + " | ".join(cells) + f" | {last / first:.1f}x |")


if __name__ == "__main__":
    main()
