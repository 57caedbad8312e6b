"""A snapshot of the public surface: changing it must be a deliberate edit of this list."""

from __future__ import annotations

import accel

PUBLIC_API = [
    "Config",
    "DDPOptions",
    "FSDPOptions",
    "RankLogger",
    "RunContext",
    "ShardBatch",
    "ShardPlan",
    "ShardedLoader",
    "accumulate",
    "any_rank",
    "autocast",
    "broadcast",
    "broadcast_object",
    "check_optimizer",
    "clip_grad_norm_",
    "clip_grad_value_",
    "compute_module_sizes",
    "cpu_offload",
    "default_config_path",
    "disk_offload",
    "dispatch_checkpoint",
    "find_executable_batch_size",
    "gather",
    "gather_for_metrics",
    "gather_object",
    "get_logger",
    "get_rng_state",
    "infer_device_map",
    "init_distributed",
    "init_empty_weights",
    "init_on_device",
    "load_config",
    "main_process_first",
    "make_scaler",
    "num_items_in_batch",
    "on_main_process",
    "optimizer_step",
    "pad_across_processes",
    "reduce",
    "remove_hooks",
    "run_on_main",
    "scaled_backward",
    "set_rng_state",
    "set_seed",
    "shard_loader",
    "should_sync",
    "shutdown",
    "split_between_processes",
    "unwrap_model",
    "wait_for_everyone",
    "wrap_model",
]


def test_public_api_snapshot() -> None:
    assert sorted(accel.__all__) == PUBLIC_API
    assert all(hasattr(accel, name) for name in PUBLIC_API)
