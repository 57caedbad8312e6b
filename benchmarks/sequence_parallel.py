"""Ulysses sequence parallelism (sp) and expert parallelism (ep) against sp=1 / ep=1 on a CPU.

At 2 gloo ranks, one thread each: the same global batch (batch x seq tokens) trained with
`wrap_model` at sp=2 (each rank: the whole batch, half of each sequence, two all-to-alls per
attention) and at dp_shard=2 (each rank: half the batch, whole sequences); then a
mixture-of-experts model at ep=2 (each rank: 2 of the 4 experts, tokens dispatched by
all-to-all) and at dp_shard=2 (every expert on every rank). Both sides are built in the same
world and stepped in alternating order; the table gives the best round of each over the best
of sp=1 / ep=1 and the median of per-round ratios, and the bytes each rank handed to its
all-to-alls per step, recorded from the collectives' own input tensors, beside the formula.

    python benchmarks/sequence_parallel.py            # 10 rounds of 3 steps
    python benchmarks/sequence_parallel.py --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.models

import accel
from accel import Parallelism
from accel._mesh import with_mesh
from accel.testing import run_world
from tests.dist.test_comm_volume_dist import AllToAllRecorder
from tests.models import EP_PLAN, MoELlama, lm_loss, make_model

DENSE = {"vocab": 512, "dim": 256, "heads": 8, "layers": 4}
BATCH, SEQ = 8, 256
STEPS = 3


def _on(ctx: accel.RunContext, parallelism: Parallelism) -> accel.RunContext:
    return with_mesh(dataclasses.replace(ctx, parallelism=None, mesh=None), parallelism,
                     source="bench")  # fmt: skip


def _side(ctx: accel.RunContext, kind: str, split: bool) -> tuple[Any, Any, torch.Tensor]:
    """(model, optimizer, this rank's tokens) of one side."""
    torch.manual_seed(0)
    tokens = torch.randint(0, DENSE["vocab"], (BATCH, SEQ + 1))
    if kind == "sp":
        ctx = _on(ctx, Parallelism(sp=2) if split else Parallelism(dp_shard=2))
        plan = ("layers.*.attention",) if split else None
        model = accel.wrap_model(ctx, make_model(**DENSE), sp_plan=plan)
    else:
        ctx = _on(ctx, Parallelism(ep=2) if split else Parallelism(dp_shard=2))
        moe = MoELlama(vocab=DENSE["vocab"], dim=DENSE["dim"], heads=DENSE["heads"], layers=2)
        model = accel.wrap_model(ctx, moe, ep_plan=EP_PLAN if split else None)
    if kind == "sp" and split:  # the whole batch, this rank's half of each sequence (+1 target)
        half = SEQ // 2
        mine = tokens[:, ctx.sp_rank * half : ctx.sp_rank * half + half + 1]
    else:
        mine = tokens.chunk(2)[ctx.dp_rank]
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), mine.to(ctx.device)


def _step(model: Any, opt: Any, tokens: torch.Tensor) -> None:
    lm_loss(model, tokens).backward()
    opt.step()
    opt.zero_grad()


def _world(ctx: accel.RunContext, kind: str, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    sides = {split: _side(ctx, kind, split) for split in (True, False)}
    for side in sides.values():
        _step(*side)  # warm up
    with AllToAllRecorder() as recorder:
        _step(*sides[True])
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for split in (True, False) if r % 2 else (False, True):
            torch.distributed.barrier()
            start = time.perf_counter()
            for _ in range(STEPS):
                _step(*sides[split])
            times[split].append(time.perf_counter() - start)
    return {"times": times, "bytes": sum(size for size, _, _ in recorder.calls)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    d, h = DENSE["dim"], DENSE["heads"]
    formulas = {  # bytes a rank hands its all-to-alls per step
        "sp": DENSE["layers"] * 2 * BATCH * (SEQ // 2) * (d // h) * 4 * h * 4,
        "ep": None,  # routing-dependent in the moved share; the total: 2 x (E x 8 + 4 n k d x 4)
    }
    formulas["ep"] = 2 * (4 * 8 + 4 * (BATCH // 2 * SEQ) * 2 * d * 4)
    print(
        "| mesh vs the same global batch at sp=1 / ep=1 (dp_shard=2) | best | median of "
        "round ratios | bytes to all-to-alls per rank and step (measured / formula) |"
    )
    print("|---|---|---|---|")
    for kind, label in (("sp", "sp=2, dense Llama dim 256, 4 blocks, seq 256"),
                        ("ep", "ep=2, 4 experts top-2, dim 256, 2 blocks, seq 256")):  # fmt: skip
        out = run_world(_world, world_size=2, args=(kind, args.rounds), timeout=1800)[0]
        split, whole = out["times"][True], out["times"][False]
        best = min(split) / min(whole)
        median = statistics.median(a / b for a, b in zip(split, whole, strict=True))
        print(f"| {label} | {best:.2f}x | {median:.2f}x | {out['bytes']:,} / {formulas[kind]:,} |")


if __name__ == "__main__":
    main()
