"""A snapshot of the public surface: changing it must be a deliberate edit of this list."""

from __future__ import annotations

import accel

PUBLIC_API = [
    "Config",
    "RankLogger",
    "RunContext",
    "any_rank",
    "broadcast",
    "broadcast_object",
    "default_config_path",
    "find_executable_batch_size",
    "gather",
    "gather_object",
    "get_logger",
    "get_rng_state",
    "init_distributed",
    "load_config",
    "main_process_first",
    "on_main_process",
    "pad_across_processes",
    "reduce",
    "run_on_main",
    "set_rng_state",
    "set_seed",
    "shutdown",
    "split_between_processes",
    "wait_for_everyone",
]


def test_public_api_snapshot() -> None:
    assert sorted(accel.__all__) == PUBLIC_API
    assert all(hasattr(accel, name) for name in PUBLIC_API)
