"""Accelerate's `fsdp_config`, `parallelism_config`, `dynamo_config` and `fp8_config`, as
accel's settings.

Each key is honoured (mapped to `FSDPOptions`, `Parallelism` or the compile mode; fp8's checked
against what `wrap_model` does under precision "fp8") or refused by name with the reason and
the fix; none is dropped. Values may be YAML's (booleans, ints) or `accel launch` flag strings
("true", "2").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from accel._parallelism import CompileMode, FSDPOptions, Parallelism

Pairs = tuple[tuple[str, Any], ...]


def _bool(key: str, value: Any) -> bool:
    text = str(value).lower()
    if isinstance(value, bool) or text in ("true", "false"):
        return value if isinstance(value, bool) else text == "true"
    raise ValueError(f"config: {key}={value!r} must be true or false.")


def _int(key: str, value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if isinstance(value, bool) or (number < 1 and number != -1):
        raise ValueError(f"config: {key}={value!r} must be an integer >= 1 (or -1 to fill).")
    return number


def _refuse(key: str, value: Any, why: str) -> None:
    raise NotImplementedError(f"config: {key}={value!r} is not supported: {why}.")


def _allow(*allowed: Any, why: str) -> Callable[[str, Any], None]:
    def check(key: str, value: Any) -> None:
        if str(value).lower() not in {str(a).lower() for a in allowed}:
            _refuse(key, value, why)

    return check


# fsdp_config keys accel accepts without a setting of its own, each with what FSDP2 does.
_FSDP_FIXED: Mapping[str, Callable[[str, Any], Any]] = MappingProxyType(
    {
        "fsdp_version": _allow(2, why="accel shards with FSDP2 (fully_shard); set fsdp_version: 2"),
        "fsdp_auto_wrap_policy": _allow(
            "TRANSFORMER_BASED_WRAP", "NO_WRAP", why="accel wraps by layer class "
            "(fsdp_transformer_layer_cls_to_wrap) or the root only; size-based wrapping is not "
            "available in FSDP2",
        ),
        "fsdp_state_dict_type": _allow(
            "SHARDED_STATE_DICT", why="accel.save_state always writes a sharded (DCP) "
            "checkpoint; write full weights with accel.save_model or `accel merge-weights`",
        ),
        "fsdp_use_orig_params": _allow(True, why="FSDP2 always keeps the original parameters"),
        "fsdp_forward_prefetch": _allow(False, why="FSDP2 prefetches by its own schedule"),
        "fsdp_backward_prefetch": _allow(
            "BACKWARD_PRE", why="FSDP2 always prefetches the next all-gather before backward"
        ),
        # accel's sharded loading reads each rank's own slices whatever this says.
        "fsdp_cpu_ram_efficient_loading": _bool,
        "fsdp_sharding_strategy": _allow(
            "FULL_SHARD", "SHARD_GRAD_OP", why="use parallelism_config (dp_replicate_size for "
            "HYBRID_SHARD) or distributed_type MULTI_CPU/MULTI_GPU (NO_SHARD)",
        ),
        "fsdp_min_num_params": _allow(why="size-based wrapping is not available in FSDP2"),
    }
)  # fmt: skip
_FSDP_OPTIONS = MappingProxyType(
    {
        "fsdp_reshard_after_forward": "reshard_after_forward",
        "fsdp_offload_params": "offload_params",
        "fsdp_sync_module_states": "sync_module_states",
    }
)
# Accelerate's FSDP key for what accel applies under every strategy (wrap_model's keyword).
_FSDP_ACTIVATION_CHECKPOINTING = "fsdp_activation_checkpointing"
FSDP_KEYS = (
    *_FSDP_FIXED, *_FSDP_OPTIONS, _FSDP_ACTIVATION_CHECKPOINTING,
    "fsdp_transformer_layer_cls_to_wrap",
)  # fmt: skip

_MESH_KEYS = MappingProxyType(
    {
        "parallelism_config_pp_size": "pp",  # accel's own key: Accelerate has no pipeline size
        "parallelism_config_dp_replicate_size": "dp_replicate",
        "parallelism_config_dp_shard_size": "dp_shard",
        "parallelism_config_cp_size": "cp",
        "parallelism_config_tp_size": "tp",
    }
)
PARALLELISM_KEYS = (*_MESH_KEYS, "parallelism_config_cp_comm_strategy")
DYNAMO_KEYS = (
    "dynamo_backend", "dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic",
    "dynamo_use_regional_compilation",
)  # fmt: skip


# Accelerate's `deepspeed_config` keys (its YAML section, its DeepSpeedPlugin fields); wrap_model
# (accel.parallel's DeepSpeed config reader) honours each or refuses it by name.
DEEPSPEED_KEYS = (
    "zero_stage", "offload_optimizer_device", "offload_param_device", "gradient_clipping",
    "zero3_init_flag", "zero3_save_16bit_model", "deepspeed_config_file",
    "gradient_accumulation_steps", "offload_optimizer_nvme_path", "offload_param_nvme_path",
    "deepspeed_multinode_launcher", "deepspeed_hostfile", "deepspeed_exclusion_filter",
    "deepspeed_inclusion_filter", "deepspeed_moe_layer_cls_names",
)  # fmt: skip
# The section's keys `accel launch` takes as flags (gradient_accumulation_steps is its own).
DEEPSPEED_FLAG_KEYS = tuple(k for k in DEEPSPEED_KEYS if k != "gradient_accumulation_steps")


def _known(section: str, pairs: Pairs, keys: tuple[str, ...]) -> dict[str, Any]:
    values = dict(pairs)
    for key in values:
        if key not in keys:
            raise ValueError(
                f"config: {section} has unknown key {key!r}; accel knows {sorted(keys)}. "
                "Remove it, or rename it to one of those."
            )
    return values


def fsdp_options(distributed_type: str, pairs: Pairs) -> FSDPOptions | None:
    """The FSDPOptions an `fsdp_config` section asks for (None when there is none)."""
    values = _known("fsdp_config", pairs, FSDP_KEYS)
    if values and distributed_type != "FSDP":
        raise ValueError(
            f"config: fsdp_config is given but distributed_type={distributed_type!r}; set "
            "distributed_type: FSDP (or --use_fsdp) to shard, or remove fsdp_config."
        )
    if not values:
        return None
    options: dict[str, Any] = {}
    for key, value in values.items():
        if key in _FSDP_FIXED:
            _FSDP_FIXED[key](key, value)
        elif key in _FSDP_OPTIONS:
            options[_FSDP_OPTIONS[key]] = _bool(key, value)
    if str(values.get("fsdp_sharding_strategy", "")).upper() == "SHARD_GRAD_OP":
        options.setdefault("reshard_after_forward", False)
    names = values.get("fsdp_transformer_layer_cls_to_wrap")
    wrap_policy = str(values.get("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP")).upper()
    if names and wrap_policy != "NO_WRAP":
        listed = names if isinstance(names, (list, tuple)) else str(names).split(",")
        options["layer_classes"] = tuple(n.strip() for n in listed if str(n).strip())
    return FSDPOptions(**options)


def deepspeed_section(distributed_type: str, pairs: Pairs) -> Pairs | None:
    """The `deepspeed_config` section `wrap_model` builds the engine from (None: no DeepSpeed)."""
    values = _known("deepspeed_config", pairs, DEEPSPEED_KEYS)
    if values and distributed_type != "DEEPSPEED":
        raise ValueError(
            f"config: deepspeed_config is given but distributed_type={distributed_type!r}; set "
            "distributed_type: DEEPSPEED (or --use_deepspeed), or remove deepspeed_config."
        )
    return tuple(sorted(values.items())) if distributed_type == "DEEPSPEED" else None


def activation_checkpointing(pairs: Pairs) -> bool:
    """Whether an `fsdp_config` section asks for activation checkpointing (RunContext's
    `activation_checkpointing`, which `wrap_model` applies under any strategy)."""
    values = _known("fsdp_config", pairs, FSDP_KEYS)
    key = _FSDP_ACTIVATION_CHECKPOINTING
    return key in values and _bool(key, values[key])


def parallelism_of(distributed_type: str, pairs: Pairs) -> Parallelism | None:
    """The mesh sizes a `parallelism_config` (or `distributed_type: FSDP`) asks for."""
    values = _known("parallelism_config", pairs, PARALLELISM_KEYS)
    strategy = values.pop("parallelism_config_cp_comm_strategy", "allgather")
    _allow("allgather", why="torch's context_parallel rotates by all-gather here")(
        "parallelism_config_cp_comm_strategy", strategy
    )
    sizes = {_MESH_KEYS[k]: _int(k, v) for k, v in values.items()}
    if sizes:
        return Parallelism(**sizes)
    if distributed_type == "FSDP":
        return Parallelism(dp_shard=-1)  # Accelerate's FSDP shards over every process
    return None


def compile_mode(pairs: Pairs) -> CompileMode:
    """What a `dynamo_config` section asks `wrap_model` to compile."""
    values: Mapping[str, Any] = _known("dynamo_config", pairs, DYNAMO_KEYS)
    backend = str(values.get("dynamo_backend", "NO")).upper()
    if backend == "NO":
        return False
    if backend != "INDUCTOR":
        _refuse("dynamo_backend", values["dynamo_backend"], "accel compiles with inductor")
    _allow("default", "None", why="accel compiles with the default mode")(
        "dynamo_mode", values.get("dynamo_mode", "default")
    )
    for key in ("dynamo_use_fullgraph", "dynamo_use_dynamic"):
        if key in values and values[key] is not None and _bool(key, values[key]):
            _refuse(key, values[key], "accel compiles with torch.compile's defaults")
    regional = _bool(
        "dynamo_use_regional_compilation", values.get("dynamo_use_regional_compilation", False)
    )
    return "regional" if regional else True


# Accelerate's fp8_config keys (YAML spells them bare, `accelerate launch` with the fp8_ prefix).
FP8_KEYS = (
    "fp8_backend", "fp8_use_autocast_during_eval", "fp8_margin", "fp8_interval", "fp8_format",
    "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_override_linear_precision",
    "fp8_opt_level", "fp8_enable_fsdp_float8_all_gather", "fp8_pad_inner_dim",
)  # fmt: skip
_TE_KEYS = frozenset(FP8_KEYS[1:8])
# Keys whose only value accel applies from a config (the default of Float8Options); another
# value is set in code, where the options reach wrap_model.
_DEFAULT_ONLY = MappingProxyType(
    {"fp8_enable_fsdp_float8_all_gather": True, "fp8_pad_inner_dim": True}
)


def check_fp8_config(precision: str, pairs: tuple[tuple[str, Any], ...]) -> None:
    """Honour or refuse, by name, each key of Accelerate's `fp8_config` section.

    Raises:
        ValueError: for an unknown key, a bad value, or fp8 settings without precision fp8.
        NotImplementedError: for Transformer Engine's or MS-AMP's backend and settings, and
            for torchao settings a config cannot carry (set them in Float8Options instead).
    """
    for key, value in pairs:
        name = key if key.startswith("fp8_") else f"fp8_{key}"
        if name not in FP8_KEYS:
            raise ValueError(
                f"config: fp8_config has unknown key {key!r}; accel knows "
                f"{sorted(k.removeprefix('fp8_') for k in FP8_KEYS)}. Remove or rename it."
            )
        if precision != "fp8":
            raise ValueError(
                f"config: fp8_config {key}={value!r} is given but mixed_precision="
                f"{precision!r}; set mixed_precision: fp8, or remove fp8_config."
            )
        _check_fp8_key(name, value)


def _check_fp8_key(name: str, value: Any) -> None:
    if name == "fp8_backend":
        if str(value).upper() in ("TE", "MSAMP"):
            engine = "Transformer Engine" if str(value).upper() == "TE" else "MS-AMP"
            raise NotImplementedError(
                f"config: fp8_config backend={value!r} ({engine}) is not supported: accel "
                "trains fp8 through torchao's float8. Set backend: AO."
            )
        if str(value).upper() != "AO":
            raise ValueError(f"config: fp8_config backend={value!r} must be AO, TE or MSAMP.")
    elif name in _TE_KEYS:
        raise NotImplementedError(
            f"config: fp8_config {name.removeprefix('fp8_')}={value!r} is a Transformer Engine "
            "setting, and accel trains fp8 through torchao (dynamic scaling, no amax history). "
            "Remove it."
        )
    elif name == "fp8_opt_level":
        raise NotImplementedError(
            f"config: fp8_config opt_level={value!r} is an MS-AMP setting, and accel trains fp8 "
            "through torchao. Remove it."
        )
    else:
        text = str(value).lower()
        if text not in ("true", "false"):
            raise ValueError(f"config: fp8_config {name}={value!r} must be true or false.")
        if (text == "true") != _DEFAULT_ONLY[name]:
            field = name.removeprefix("fp8_")
            raise NotImplementedError(
                f"config: fp8_config {field}={value!r} cannot reach wrap_model from a config; "
                f"pass it in code: wrap_model(ctx, model, fp8=Float8Options({field}=False))."
            )
