"""The DeepSpeed training step through accel's calls against the same engine driven by hand.

At 2 CPU ranks (gloo), for ZeRO-2 and ZeRO-3 (a world each): two engines of one model, each built by
`accel.wrap_model(strategy="deepspeed")` (the same config reaches `deepspeed.initialize` both
ways, so the engines are identical). One is stepped with accel's calls (`accumulate`,
`scaled_backward`, `clip_grad_norm_`, `optimizer_step`, `optimizer.zero_grad()`), the other by
hand as DeepSpeed's docs write it (`set_gradient_accumulation_boundary`, `loss.backward()`,
`engine.step()`). Rounds alternate which goes first; the table reports accel's best round time
over the hand best, and the median over rounds of the ratio of the two times of a round.
A third engine, of the same model and config, is prepared by Accelerate (`DeepSpeedPlugin`,
`accelerator.accumulate`, `accelerator.backward`, `optimizer.step()`); its column is
Accelerate's best round over the hand best.

    python benchmarks/deepspeed_step.py            # 20 rounds
    python benchmarks/deepspeed_step.py --quick    # 5 rounds

(Not named deepspeed.py: a script's folder comes first on sys.path, and would shadow deepspeed.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import accel
from accel.testing import run_world

WIDTH, DEPTH, MICRO, ACCUM, STEPS = 512, 6, 32, 2, 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 1))


def _engine(ctx: accel.RunContext, stage: int) -> tuple[Any, torch.optim.Optimizer]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config = {"zero_stage": stage, "gradient_clipping": 1.0}
    ds = accel.DeepSpeedOptions(config=config, optimizer=optimizer, micro_batch_size=MICRO)
    return accel.wrap_model(ctx, model, strategy="deepspeed", deepspeed=ds), optimizer


def _accel_steps(ctx: accel.RunContext, engine: Any, opt: torch.optim.Optimizer, data: Any) -> None:
    for step, (x, y) in enumerate(data):
        with accel.accumulate(ctx, engine, step) as sync:
            loss = F.mse_loss(engine(x), y)
            accel.scaled_backward(ctx, loss)
        if sync:
            accel.clip_grad_norm_(ctx, engine, 1.0)
            accel.optimizer_step(ctx, opt)
            opt.zero_grad()


def _hand_steps(engine: Any, data: Any) -> None:
    for step, (x, y) in enumerate(data):
        sync = (step + 1) % ACCUM == 0
        engine.set_gradient_accumulation_boundary(sync)
        loss = F.mse_loss(engine(x), y)
        (loss / ACCUM).backward()
        if sync:
            engine.step()


def _accelerate_engine(stage: int) -> tuple[Any, Any, Any]:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # what `accelerate launch` exports
    plugin = DeepSpeedPlugin(
        zero_stage=stage, gradient_clipping=1.0, gradient_accumulation_steps=ACCUM
    )
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = MICRO
    plugin.deepspeed_config["train_batch_size"] = MICRO * ACCUM * 2
    acc = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=ACCUM)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _accelerate_steps(acc: Any, model: Any, opt: Any, data: Any) -> None:
    for x, y in data:
        with acc.accumulate(model):
            loss = F.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()


def _world(ctx: accel.RunContext, rounds: int, stage: int) -> tuple[float, float, float]:
    """One stage per world: Accelerate allows one Accelerator (plugin) per process."""
    for key, value in (("LOCAL_RANK", ctx.local_rank), ("RANK", ctx.rank)):
        os.environ[key] = str(value)  # what torchrun exports and DeepSpeed reads
    os.environ["WORLD_SIZE"] = str(ctx.world_size)
    torch.set_num_threads(1)
    ctx = accel.RunContext(**{**_fields(ctx), "grad_accum_steps": ACCUM})
    g = torch.Generator().manual_seed(ctx.rank)
    data = [(torch.randn(MICRO, WIDTH, generator=g), torch.randn(MICRO, 1, generator=g))
            for _ in range(STEPS * ACCUM)]  # fmt: skip
    ours, opt = _engine(ctx, stage)
    theirs, _ = _engine(ctx, stage)
    hf = _accelerate_engine(stage)
    runs = {
        "accel": lambda: _accel_steps(ctx, ours, opt, data),
        "hand": lambda: _hand_steps(theirs, data),
        "accelerate": lambda: _accelerate_steps(*hf, data),
    }
    for run in runs.values():
        run()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for who in order:
            accel.wait_for_everyone(ctx)
            start = time.perf_counter()
            runs[who]()
            times[who].append(time.perf_counter() - start)
    best = min(times["accel"]) / min(times["hand"])
    median = statistics.median(a / h for a, h in zip(times["accel"], times["hand"], strict=True))
    hf_best = min(times["accelerate"]) / min(times["hand"])
    return best, median, hf_best


def _fields(ctx: accel.RunContext) -> dict[str, Any]:
    names = ("rank", "local_rank", "world_size", "local_world_size", "device", "backend")
    return {n: getattr(ctx, n) for n in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds instead of 20")
    args = parser.parse_args()
    rounds = 5 if args.quick else 20
    result = {
        f"ZeRO-{stage}": run_world(_world, world_size=2, timeout=1800, args=(rounds, stage))[0]
        for stage in (2, 3)
    }
    print(f"{rounds} rounds of {STEPS} optimizer steps (accumulation {ACCUM}), 2 gloo ranks")
    print("| engine | best accel / best hand | median of ratios | best Accelerate / best hand |")
    print("|---|---|---|---|")
    for name, (best, median, hf_best) in result.items():
        print(f"| {name} | {best:.3f}x | {median:.3f}x | {hf_best:.3f}x |")


if __name__ == "__main__":
    main()
