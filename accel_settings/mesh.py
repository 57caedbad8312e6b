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


def _choice(name: str, help: str, allowed: tuple[Any, ...], why: str) -> Setting:
    """A key of Accelerate's section that builds no Parallelism part: one value honoured."""
    key = f"parallelism_config_{name}"
    return Setting(key=key, kind="any", accelerate_env=key.upper(), allowed=(allowed, why),
                   help=help)  # fmt: skip


def _rules(values: Mapping[str, Any], found: Mapping[str, Any], config: Any) -> dict[str, Any]:
    length = values.get("parallelism_config_sp_seq_length")
    size = found.get("parallelism", {}).get("sp", 1)
    if length is not None and size > 1 and length % size:
        raise ValueError(
            f"config: parallelism_config_sp_seq_length={length} is not divisible by "
            f"parallelism_config_sp_size={size}; each sp rank holds length / sp tokens. "
            "Use a length that is a multiple of the sp size."
        )
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
        _size("sp", "Ulysses sequence-parallel size (all-to-all around attention)"),
        _size("ep", "expert-parallel size (accel's key: experts split over ep ranks)"),
        _choice("sp_backend", "deepspeed: Ulysses, which accel runs itself", ("deepspeed",),
                "accel runs Ulysses itself, the algorithm of DeepSpeed's sequence parallelism "
                "(Accelerate's only sp_backend)"),
        Setting(key="parallelism_config_sp_seq_length", kind="optional_count",
                accelerate_env="PARALLELISM_CONFIG_SP_SEQ_LENGTH",
                help="sequence length (checked: divisible by the sp size)"),
        Setting(key="parallelism_config_sp_seq_length_is_variable", kind="any",
                accelerate_env="PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE",
                help="accel checks every batch's length, variable or not"),
        _choice("sp_attn_implementation", "sdpa (torch's scaled_dot_product_attention)",
                ("sdpa",), "accel's Ulysses wraps torch's scaled_dot_product_attention, which "
                "transformers runs for attn_implementation='sdpa'"),
        _choice("cp_comm_strategy", "allgather (torch's context_parallel rotation)",
                ("allgather",), "torch's context_parallel rotates by all-gather here"),
    ),
)  # fmt: skip
