"""The FSDP section of the settings table: Accelerate's `fsdp_config` keys and `FSDPOptions`.

Each key is honoured (an `FSDPOptions` part, or `activation_checkpointing` of RunContext's
`wrap`) or refused by name with the reason and the fix; none is dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from accel_settings._rows import Section, Setting

# Keys accel accepts without a setting of its own: the values FSDP2 honours, and why.
_FIXED = MappingProxyType(
    {
        "fsdp_version": ((2,), "accel shards with FSDP2 (fully_shard); set fsdp_version: 2"),
        "fsdp_auto_wrap_policy": (
            ("TRANSFORMER_BASED_WRAP", "NO_WRAP"), "accel wraps by layer class "
            "(fsdp_transformer_layer_cls_to_wrap) or the root only; size-based wrapping is not "
            "available in FSDP2",
        ),
        "fsdp_state_dict_type": (
            ("SHARDED_STATE_DICT",), "accel.save_state always writes a sharded (DCP) "
            "checkpoint; write full weights with accel.save_model or `accel merge-weights`",
        ),
        "fsdp_use_orig_params": ((True,), "FSDP2 always keeps the original parameters"),
        "fsdp_forward_prefetch": ((False,), "FSDP2 prefetches by its own schedule"),
        "fsdp_backward_prefetch": (
            ("BACKWARD_PRE",), "FSDP2 always prefetches the next all-gather before backward"
        ),
        "fsdp_sharding_strategy": (
            ("FULL_SHARD", "SHARD_GRAD_OP"), "use parallelism_config (dp_replicate_size for "
            "HYBRID_SHARD) or distributed_type MULTI_CPU/MULTI_GPU (NO_SHARD)",
        ),
        "fsdp_min_num_params": ((), "size-based wrapping is not available in FSDP2"),
    }
)  # fmt: skip


def _fixed(key: str, help: str) -> Setting:
    return Setting(key=key, kind="any", accelerate_env=key.upper(), help=help,
                   allowed=_FIXED[key])  # fmt: skip


def _option(key: str, part: str, help: str) -> Setting:
    return Setting(key=key, kind="bool", field="fsdp", part=part, env=f"ACCEL_FSDP_{part.upper()}",
                   accelerate_env=key.upper(), help=help)  # fmt: skip


def _rules(values: Mapping[str, Any], found: Mapping[str, Any], config: Any) -> dict[str, Any]:
    if not values:
        return {}
    options = dict(found.get("fsdp", {}))  # an FSDP run gets FSDPOptions, its defaults or not
    if str(values.get("fsdp_sharding_strategy", "")).upper() == "SHARD_GRAD_OP":
        options.setdefault("reshard_after_forward", False)
    if str(values.get("fsdp_auto_wrap_policy", "")).upper() == "NO_WRAP":
        options.pop("layer_classes", None)  # the root is the only unit
    return {**found, "fsdp": options}


SECTION = Section(
    name="fsdp_config",
    title="FSDP Arguments",
    description="Arguments related to Fully Sharded Data Parallelism (FSDP2).",
    shown_with="use_fsdp",
    order=40,
    env_prefix="ACCEL_FSDP_",
    accelerate_switch=(("ACCELERATE_USE_FSDP", "true"), ("FSDP_VERSION", "2")),
    active=lambda config: config.distributed_type == "FSDP",
    strategy=("FSDP", "--use_fsdp"),
    rules=_rules,
    settings=(
        _fixed("fsdp_version", "FSDP version; accel shards with FSDP2 (2)"),
        _fixed("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP or NO_WRAP"),
        _fixed("fsdp_state_dict_type", "SHARDED_STATE_DICT (save_state writes DCP)"),
        _fixed("fsdp_use_orig_params", "true (FSDP2 keeps the original parameters)"),
        _fixed("fsdp_forward_prefetch", "false (FSDP2 prefetches by its own schedule)"),
        _fixed("fsdp_backward_prefetch", "BACKWARD_PRE (FSDP2's schedule)"),
        Setting(key="fsdp_cpu_ram_efficient_loading", kind="bool",
                accelerate_env="FSDP_CPU_RAM_EFFICIENT_LOADING",
                help="accepted: accel's sharded loading reads each rank's own slices"),
        _fixed("fsdp_sharding_strategy", "FULL_SHARD or SHARD_GRAD_OP (no reshard after forward)"),
        _fixed("fsdp_min_num_params", "refused: FSDP2 has no size-based wrapping"),
        _option("fsdp_reshard_after_forward", "reshard_after_forward",
                "free gathered parameters after forward (true/false)"),
        _option("fsdp_offload_params", "offload_params",
                "keep sharded parameters and gradients on the CPU (true/false)"),
        _option("fsdp_sync_module_states", "sync_module_states",
                "broadcast rank 0's parameters before sharding (true/false)"),
        Setting(key="fsdp_activation_checkpointing", kind="bool", default=False,
                field="activation_checkpointing", env="ACCEL_ACTIVATION_CHECKPOINTING",
                accelerate_env="FSDP_ACTIVATION_CHECKPOINTING",
                help="recompute each block's activations in backward (any strategy)"),
        Setting(key="fsdp_transformer_layer_cls_to_wrap", kind="class_names", field="fsdp",
                part="layer_classes", env="ACCEL_FSDP_LAYER_CLASSES",
                accelerate_env="FSDP_TRANSFORMER_CLS_TO_WRAP",
                help="layer class names, each its own FSDP2 unit, e.g. Block,Attention"),
        Setting(key=None, kind="text", field="fsdp", part="param_dtype",
                env="ACCEL_FSDP_PARAM_DTYPE", help="FSDPOptions.param_dtype"),
        Setting(key=None, kind="text", field="fsdp", part="reduce_dtype",
                env="ACCEL_FSDP_REDUCE_DTYPE", help="FSDPOptions.reduce_dtype"),
    ),
)  # fmt: skip
