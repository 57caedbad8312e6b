"""The mesh section of the settings table: Accelerate's `parallelism_config` keys (and accel's
pipeline size), `Parallelism` in RunContext, the `ACCEL_*_SIZE` variables.

Declarations import only the standard library and `accel_cli._setting`; see _settings_fsdp.
"""

from __future__ import annotations

from typing import Any

from accel_cli._setting import Section, Setting


def _size(dim: str, help: str, *flags: str) -> Setting:
    key = f"parallelism_config_{dim}_size"
    return Setting(key=key, kind="mesh_size", field="parallelism", part=dim,
                   env=f"ACCEL_{dim.upper()}_SIZE", accelerate_env=key.upper(), flags=flags,
                   help=help)  # fmt: skip


def _build(config: Any) -> dict[str, Any]:
    from accel._parallelism import Parallelism  # on use
    from accel._settings.values import allow, known, parse  # on use

    values = known(config, SECTION)
    strategy = values.pop("parallelism_config_cp_comm_strategy", "allgather")
    allow("parallelism_config_cp_comm_strategy", strategy, ("allgather",),
          "torch's context_parallel rotates by all-gather here")  # fmt: skip
    parts = {
        str(s.part): parse(s.kind, s.key, values[s.key])
        for s in SECTION.settings
        if s.key in values
    }
    if parts:
        return {"parallelism": Parallelism(**parts)}
    if config.distributed_type == "FSDP":
        return {"parallelism": Parallelism(dp_shard=-1)}  # Accelerate's FSDP shards over all
    return {}


def _compose(field: str, parts: dict[str, Any]) -> Any:
    from accel._parallelism import Parallelism  # on use

    return Parallelism(**parts)


SECTION = Section(
    name="parallelism_config",
    title="ParallelismConfig Arguments",
    description="Arguments related to the ParallelismConfig used for distributed training.",
    order=60,
    accelerate_switch=(("ACCELERATE_USE_PARALLELISM_CONFIG", "true"),),
    active=lambda config: bool(config.parallelism_config),
    build=_build,
    compose=_compose,
    settings=(
        _size("pp", "pipeline stages (accel's key: Accelerate has no pipeline size)"),
        _size("dp_replicate", "replicas (DDP, or HSDP's outer dimension)"),
        _size("dp_shard", "ranks FSDP2 shards over (-1 fills the world)"),
        _size("cp", "context-parallel size (CUDA only)"),
        _size("tp", "tensor-parallel size", "tp_size"),
        Setting(key="parallelism_config_cp_comm_strategy", kind="any",
                accelerate_env="PARALLELISM_CONFIG_CP_COMM_STRATEGY",
                help="allgather (torch's context_parallel rotation)"),
    ),
)  # fmt: skip
