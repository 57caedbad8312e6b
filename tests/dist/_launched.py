"""A script started as plain processes with a launcher's environment (see test_distributed_dist).

    python _launched.py MODE OUTDIR TIMEOUT_S

Waits until every process is up (so a short collective timeout does not also bound the
imports), joins the run with `accel.init_distributed`, and writes what it saw to OUTDIR/RANK.json.
MODE "timeout": rank 0 calls wait_for_everyone alone and records how long the failure took.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import accel


def _file_barrier(outdir: Path, name: str, rank: int, world_size: int) -> None:
    (outdir / f"{name}{rank}").write_text("")
    deadline = time.monotonic() + 120
    while not all((outdir / f"{name}{r}").exists() for r in range(world_size)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: not every process started")
        time.sleep(0.02)


def main() -> None:
    mode, outdir, timeout = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
    rank, world_size = int(sys.argv[4]), int(sys.argv[5])
    _file_barrier(outdir, "ready", rank, world_size)
    ctx = accel.init_distributed(device="cpu", timeout=timeout)
    report = {
        "topology": [ctx.rank, ctx.local_rank, ctx.world_size, ctx.local_world_size],
        "nodes": [ctx.node_rank, ctx.num_nodes],
        "backend": ctx.backend,
        "precision": ctx.precision,
        "sources": dict(ctx.sources),
        "describe": ctx.describe(),
        "gather": accel.gather(ctx, torch.tensor([2 * ctx.rank + 1, 2 * ctx.rank + 2])).tolist(),
        "any_rank": accel.any_rank(ctx, ctx.rank == 1),
    }
    if mode == "timeout":
        if ctx.rank == 0:
            start = time.monotonic()
            try:
                accel.wait_for_everyone(ctx)
            except RuntimeError as err:
                report["error"] = str(err)
            report["elapsed"] = time.monotonic() - start
            (outdir / "timed_out").write_text("")
        else:  # stays alive without joining the barrier until rank 0 has seen the timeout
            deadline = time.monotonic() + 120
            while not (outdir / "timed_out").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
    accel.shutdown(ctx)
    report["initialized_after_shutdown"] = dist.is_initialized()
    (outdir / f"{ctx.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
