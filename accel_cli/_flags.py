"""The `accel launch` flags that the command's parser and `accel.cli` both read.

Below both: `accel_cli` builds its parser from them, and `accel.cli` (which `accel_cli.main`
runs) turns the parsed flags into settings. Kept apart from the parser so that `accel.cli`
imports this table and not the package that imports `accel.cli`: no import circle.
"""

from __future__ import annotations

from typing import Any

# `accel launch` flags that override a config key of the same name: name, type, metavar, help.
LAUNCH_OVERRIDES: tuple[tuple[str, Any, str], ...] = (
    ("num_processes", int, "processes in total, over all machines"),
    ("num_machines", int, "machines taking part"),
    ("machine_rank", int, "this machine's index"),
    ("main_process_ip", str, "address of machine 0 (the rendezvous host)"),
    ("main_process_port", int, "rendezvous port; 0 picks a free one (one machine only)"),
    ("rdzv_backend", str, "torchrun rendezvous backend: static or c10d"),
    ("max_restarts", int, "how often the elastic agent restarts failed workers"),
    ("monitor_interval", float, "seconds between the agent's checks on its workers"),
    ("mixed_precision", str, "fp32 (or Accelerate's 'no'), bf16, fp16 or fp8"),
    ("gradient_accumulation_steps", int, "micro-batches per optimizer step"),
    ("num_cpu_threads_per_process", int, "OMP/torch threads per process"),
    ("gpu_ids", str, "comma-separated GPU ids to use, or 'all'"),
    ("seed", int, "base seed recorded in every process's RunContext"),
    ("log_with", str, "trackers init_trackers builds by default, e.g. wandb,mlflow"),
)

# Accelerate's nested config sections and the `accelerate launch` flags that fill them (the
# keys accel._accelerate_config honours or refuses by name; a test keeps the two in step).
SECTION_FLAGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("fsdp_config", (
        "fsdp_version", "fsdp_auto_wrap_policy", "fsdp_state_dict_type", "fsdp_use_orig_params",
        "fsdp_forward_prefetch", "fsdp_backward_prefetch", "fsdp_cpu_ram_efficient_loading",
        "fsdp_sharding_strategy", "fsdp_min_num_params", "fsdp_reshard_after_forward",
        "fsdp_offload_params", "fsdp_sync_module_states", "fsdp_activation_checkpointing",
        "fsdp_transformer_layer_cls_to_wrap",
    )),
    ("parallelism_config", (
        "parallelism_config_pp_size", "parallelism_config_dp_replicate_size",
        "parallelism_config_dp_shard_size", "parallelism_config_cp_size",
        "parallelism_config_tp_size",
        "parallelism_config_cp_comm_strategy",
    )),
    ("dynamo_config", (
        "dynamo_backend", "dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic",
        "dynamo_use_regional_compilation",
    )),
    ("fp8_config", (
        "fp8_backend", "fp8_use_autocast_during_eval", "fp8_margin", "fp8_interval", "fp8_format",
        "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_override_linear_precision",
        "fp8_opt_level", "fp8_enable_fsdp_float8_all_gather", "fp8_pad_inner_dim",
    )),
    ("deepspeed_config", (
        "zero_stage", "offload_optimizer_device", "offload_param_device", "gradient_clipping",
        "zero3_init_flag", "zero3_save_16bit_model", "deepspeed_config_file",
        "offload_optimizer_nvme_path", "offload_param_nvme_path", "deepspeed_multinode_launcher",
        "deepspeed_hostfile", "deepspeed_exclusion_filter", "deepspeed_inclusion_filter",
        "deepspeed_moe_layer_cls_names",
    )),
)  # fmt: skip
