"""A snapshot of the public surface: changing it must be a deliberate edit of this list."""

from __future__ import annotations

import accel

PUBLIC_API = [
    "CheckpointHandle",
    "Config",
    "DDPOptions",
    "FSDPOptions",
    "PerRank",
    "RankLogger",
    "RunContext",
    "accumulate",
    "any_rank",
    "autocast",
    "broadcast",
    "broadcast_object",
    "check_optimizer",
    "clip_grad_norm_",
    "clip_grad_value_",
    "default_config_path",
    "find_executable_batch_size",
    "gather",
    "gather_object",
    "get_logger",
    "get_rng_state",
    "init_distributed",
    "latest_checkpoint",
    "load_checkpoint_in_model",
    "load_config",
    "load_state",
    "main_process_first",
    "make_scaler",
    "num_items_in_batch",
    "on_main_process",
    "optimizer_step",
    "pad_across_processes",
    "reduce",
    "run_on_main",
    "save_checkpoint",
    "save_model",
    "save_state",
    "scaled_backward",
    "set_rng_state",
    "set_seed",
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
