"""estimate_memory against measurement: the same step really run at 1, 2 and 4 gloo ranks.

Each layout's estimate (fake tensors, fake world) is compared with the peak the same step
reaches for real, measured with the same account (every live storage, by category) on every
rank of a real world. One `run_world` per world size runs all of that size's layouts in turn.
The error table is printed (`pytest -s` shows it; docs/estimate.md holds a copy) and every
estimate must be within 10% of the measured peak of every rank of its role.
"""

from __future__ import annotations

from typing import Any

import pytest

import accel
from accel.config import Config
from accel.estimate import _plan
from accel.estimate._spec import StepSpec
from accel.estimate._step import run_steps
from accel.testing import run_world
from tests.models import TP_PLAN, Llama

pytestmark = [pytest.mark.dist, pytest.mark.slow]

BATCH = (4, 32)
TOLERANCE = 0.10


def small_llama() -> Llama:
    return Llama(vocab=512, dim=64, heads=4, layers=2)


def _mesh(**sizes: int) -> tuple[tuple[str, int], ...]:
    return tuple((f"parallelism_config_{k}_size", v) for k, v in sizes.items())


def _fsdp(**keys: Any) -> tuple[tuple[str, Any], ...]:
    return tuple((f"fsdp_{k}", v) for k, v in keys.items())


# name -> (config, optimizer)
LAYOUTS: dict[str, tuple[Config, str]] = {
    "1 process fp32 AdamW": (Config(), "adamw"),
    "1 process bf16 AdamW": (Config(mixed_precision="bf16"), "adamw"),
    "1 process fp32 SGD": (Config(), "sgd"),
    "1 process bf16 SGD": (Config(mixed_precision="bf16"), "sgd"),
    "DDP 2 fp32 AdamW": (Config(num_processes=2, distributed_type="MULTI_CPU"), "adamw"),
    "DDP 2 bf16 SGD": (
        Config(num_processes=2, distributed_type="MULTI_CPU", mixed_precision="bf16"), "sgd"),
    "FSDP2 2 reshard": (Config(num_processes=2, distributed_type="FSDP"), "adamw"),
    "FSDP2 2 no reshard": (
        Config(num_processes=2, distributed_type="FSDP",
               fsdp_config=_fsdp(reshard_after_forward=False)), "adamw"),
    "FSDP2 2 per block": (
        Config(num_processes=2, distributed_type="FSDP",
               fsdp_config=_fsdp(transformer_layer_cls_to_wrap="Block")), "adamw"),
    "FSDP2 2 per block, no reshard": (
        Config(num_processes=2, distributed_type="FSDP",
               fsdp_config=_fsdp(transformer_layer_cls_to_wrap="Block",
                                 reshard_after_forward=False)), "adamw"),
    "FSDP2 2 per block, activation checkpointing": (
        Config(num_processes=2, distributed_type="FSDP",
               fsdp_config=_fsdp(transformer_layer_cls_to_wrap="Block",
                                 activation_checkpointing=True)), "adamw"),
    "FSDP2 2 bf16 SGD": (
        Config(num_processes=2, distributed_type="FSDP", mixed_precision="bf16"), "sgd"),
    "TP 2": (Config(num_processes=2, parallelism_config=_mesh(tp=2)), "adamw"),
    "TP 2 bf16": (Config(num_processes=2, mixed_precision="bf16",
                         parallelism_config=_mesh(tp=2)), "adamw"),
    "DDP 4": (Config(num_processes=4, distributed_type="MULTI_CPU"), "adamw"),
    "FSDP2 4 per block": (
        Config(num_processes=4, distributed_type="FSDP",
               fsdp_config=_fsdp(transformer_layer_cls_to_wrap="Block")), "adamw"),
    "FSDP2 4 bf16 activation checkpointing": (
        Config(num_processes=4, distributed_type="FSDP", mixed_precision="bf16",
               fsdp_config=_fsdp(transformer_layer_cls_to_wrap="Block",
                                 activation_checkpointing=True)), "adamw"),
    "HSDP 2x2": (Config(num_processes=4, parallelism_config=_mesh(dp_replicate=2, dp_shard=2)),
                 "adamw"),
    "HSDP 2x2 SGD bf16": (
        Config(num_processes=4, mixed_precision="bf16",
               parallelism_config=_mesh(dp_replicate=2, dp_shard=2)), "sgd"),
    "FSDP2 2 x TP 2": (Config(num_processes=4, parallelism_config=_mesh(dp_shard=2, tp=2)),
                       "adamw"),
    "FSDP2 2 x TP 2 per block, no reshard": (
        Config(num_processes=4, distributed_type="FSDP", parallelism_config=_mesh(dp_shard=2, tp=2),
               fsdp_config=_fsdp(transformer_layer_cls_to_wrap="Block",
                                 reshard_after_forward=False)), "adamw"),
    "FSDP2 2 x TP 2 bf16 activation checkpointing": (
        Config(num_processes=4, distributed_type="FSDP", mixed_precision="bf16",
               parallelism_config=_mesh(dp_shard=2, tp=2),
               fsdp_config=_fsdp(transformer_layer_cls_to_wrap="Block",
                                 activation_checkpointing=True)), "adamw"),
    "TP 4": (Config(num_processes=4, parallelism_config=_mesh(tp=4)), "sgd"),
}  # fmt: skip


def _spec(optimizer: str) -> StepSpec:
    return StepSpec(build=small_llama, batch=BATCH, optimizer=optimizer, tp_plan=TP_PLAN)


def _measure(ctx: accel.RunContext, names: list[str]) -> dict[str, int]:
    """This rank's measured peak of each layout (real tensors, the real gloo world)."""
    peaks = {}
    for name in names:
        config, optimizer = LAYOUTS[name]
        layout = _plan.layout(config)
        usage = run_steps(_plan.context(layout, ctx.rank), _spec(optimizer))
        peaks[name] = usage.peak
    return peaks


def _error_table(rows: list[tuple[str, int, int, int]]) -> str:
    lines = ["| layout | rank | estimated | measured | error |", "|---|---|---|---|---|"]
    for name, rank, estimated, measured in rows:
        error = (estimated - measured) / measured
        lines.append(
            f"| {name} | {rank} | {estimated / 2**20:.3f} MiB | {measured / 2**20:.3f} MiB "
            f"| {error:+.1%} |"
        )
    return "\n".join(lines)


def test_every_estimate_is_within_ten_percent_of_the_measured_peak() -> None:
    by_world: dict[int, list[str]] = {}
    for name, (config, _) in LAYOUTS.items():
        by_world.setdefault(config.num_processes, []).append(name)
    assert len(LAYOUTS) >= 20 and sorted(by_world) == [1, 2, 4]
    rows = []
    for world, names in sorted(by_world.items()):
        measured = run_world(_measure, world_size=world, timeout=240, args=(names,))
        for name in names:
            config, optimizer = LAYOUTS[name]
            estimate = accel.estimate_memory(
                small_llama, BATCH, config=config, optimizer=optimizer, tp_plan=TP_PLAN,
                device="cpu",
            )  # fmt: skip
            for role in estimate.ranks:
                for rank in role.ranks:
                    rows.append((name, rank, role.peak, measured[rank][name]))
    print("\n" + _error_table(rows))
    worst = max(rows, key=lambda r: abs(r[2] - r[3]) / r[3])
    assert abs(worst[2] - worst[3]) / worst[3] <= TOLERANCE, _error_table([worst])
