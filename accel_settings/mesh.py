"""The mesh section of the settings table: Accelerate's `parallelism_config` keys (and accel's
pipeline size), `Parallelism` in RunContext, the `ACCEL_*_SIZE` variables.

A size is one `_size` row: its `part` is the `Parallelism` field it sets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from accel_settings._rows import Section, Setting


def _size(dim: str, help: str, *flags: str) -> Setting:
    key = f"parallelism_config_{dim}_size"
    return Setting(key=key, kind="mesh_size", field="parallelism", part=dim,
                   env=f"ACCEL_{dim.upper()}_SIZE", accelerate_env=key.upper(), flags=flags,
                   help=help)  # fmt: skip


def _rules(values: Mapping[str, Any], found: Mapping[str, Any], config: Any) -> dict[str, Any]:
    if "parallelism" not in found and config.distributed_type == "FSDP":
        return {"parallelism": {"dp_shard": -1}}  # Accelerate's FSDP shards over every rank
    return dict(found)


SECTION = Section(
    name="parallelism_config",
    title="ParallelismConfig Arguments",
    description="Arguments related to the ParallelismConfig used for distributed training.",
    order=60,
    accelerate_switch=(("ACCELERATE_USE_PARALLELISM_CONFIG", "true"),),
    active=lambda config: bool(config.parallelism_config),
    rules=_rules,
    settings=(
        _size("pp", "pipeline stages (accel's key: Accelerate has no pipeline size)"),
        _size("dp_replicate", "replicas (DDP, or HSDP's outer dimension)"),
        _size("dp_shard", "ranks FSDP2 shards over (-1 fills the world)"),
        _size("cp", "context-parallel size (CUDA only)"),
        _size("tp", "tensor-parallel size", "tp_size"),
        Setting(key="parallelism_config_cp_comm_strategy", kind="any",
                accelerate_env="PARALLELISM_CONFIG_CP_COMM_STRATEGY",
                allowed=(("allgather",), "torch's context_parallel rotates by all-gather here"),
                help="allgather (torch's context_parallel rotation)"),
    ),
)  # fmt: skip
