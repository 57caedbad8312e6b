"""accel: distributed PyTorch training as small functions over an explicit `RunContext`."""

from accel.batch_size import find_executable_batch_size
from accel.collectives import (
    broadcast,
    broadcast_object,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
)
from accel.config import Config, default_config_path, load_config
from accel.context import RunContext
from accel.distributed import (
    any_rank,
    init_distributed,
    main_process_first,
    on_main_process,
    run_on_main,
    shutdown,
    split_between_processes,
    wait_for_everyone,
)
from accel.logging import RankLogger, get_logger
from accel.seeding import get_rng_state, set_rng_state, set_seed

__all__ = [
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
