"""accel: distributed PyTorch training as small functions over an explicit `RunContext`."""

import sys

if sys.argv[:1] == ["-m"]:  # Python is locating a `-m` module: `python -m accel --help`?
    from accel_cli import answer_help_early  # only under -m: a plain import reads no argv

    answer_help_early()  # answered (and exits) before the imports below import torch

from accel._version import __version__ as __version__
from accel.accumulate import (
    accumulate,
    num_items_in_batch,
    should_sync,
)
from accel.batch_size import (
    find_executable_batch_size,
)
from accel.big_model import (
    compute_module_sizes,
    cpu_offload,
    describe_device_map,
    disk_offload,
    dispatch_checkpoint,
    infer_device_map,
    init_empty_weights,
    init_on_device,
    remove_hooks,
)
from accel.checkpoint import (
    CheckpointHandle,
    LoadResult,
    PerRank,
    latest_checkpoint,
    load_checkpoint_in_model,
    load_state,
    save_checkpoint,
    save_model,
    save_state,
)
from accel.collectives import (
    broadcast,
    broadcast_object,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
)
from accel.config import Config, default_config_path, load_config
from accel.context import (
    Parallelism,
    RunContext,
    WrapDefaults,
    along,
)
from accel.data import (
    ShardBatch,
    ShardedLoader,
    ShardPlan,
    gather_for_metrics,
    shard_loader,
)
from accel.distributed import (
    init_distributed,
    shutdown,
)
from accel.estimate import (
    MemoryEstimate,
    RankMemory,
    estimate_memory,
)
from accel.local_sgd import (
    average_parameters,
    local_sgd,
    local_sgd_step,
)
from accel.logging import (
    RankLogger,
    get_logger,
)
from accel.notebook import (
    notebook_launch,
)
from accel.parallel import (
    DDPOptions,
    ExpertParallel,
    Float8Options,
    FSDPOptions,
    PipelineStages,
    check_optimizer,
    pipeline_stages,
    pipeline_step,
    unwrap_model,
    wrap_model,
)
from accel.parallel.deepspeed import (
    DeepSpeedOptions,
    build_deepspeed_ops,
    deepspeed_engine,
)
from accel.precision import (
    autocast,
    clip_grad_norm_,
    clip_grad_value_,
    make_scaler,
    optimizer_step,
    scaled_backward,
)
from accel.preemption import (
    Preemption,
    preemption,
)
from accel.process_control import (
    any_rank,
    local_main_process_first,
    main_process_first,
    on_last_process,
    on_local_main_process,
    on_main_process,
    on_process,
    run_on_main,
    split_between_processes,
    wait_for_everyone,
)
from accel.profiling import (
    profile,
)
from accel.seeding import (
    get_rng_state,
    set_rng_state,
    set_seed,
)
from accel.throughput import (
    num_flops_per_token,
    throughput_metrics,
)
from accel.tracking import (
    BUILTIN_TRACKERS,
    JSONLTracker,
    MLflowTracker,
    TensorBoardTracker,
    Tracker,
    TrackerFactory,
    TrackioTracker,
    WandbTracker,
    init_trackers,
    log_hparams,
    log_metrics,
    progress,
    register_tracker,
)

__all__ = [
    "BUILTIN_TRACKERS",
    "CheckpointHandle",
    "Config",
    "DDPOptions",
    "DeepSpeedOptions",
    "ExpertParallel",
    "FSDPOptions",
    "Float8Options",
    "JSONLTracker",
    "LoadResult",
    "MLflowTracker",
    "MemoryEstimate",
    "Parallelism",
    "PerRank",
    "PipelineStages",
    "Preemption",
    "RankLogger",
    "RankMemory",
    "RunContext",
    "ShardBatch",
    "ShardPlan",
    "ShardedLoader",
    "TensorBoardTracker",
    "Tracker",
    "TrackerFactory",
    "TrackioTracker",
    "WandbTracker",
    "WrapDefaults",
    "accumulate",
    "along",
    "any_rank",
    "autocast",
    "average_parameters",
    "broadcast",
    "broadcast_object",
    "build_deepspeed_ops",
    "check_optimizer",
    "clip_grad_norm_",
    "clip_grad_value_",
    "compute_module_sizes",
    "cpu_offload",
    "deepspeed_engine",
    "default_config_path",
    "describe_device_map",
    "disk_offload",
    "dispatch_checkpoint",
    "estimate_memory",
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
    "init_trackers",
    "latest_checkpoint",
    "load_checkpoint_in_model",
    "load_config",
    "load_state",
    "local_main_process_first",
    "local_sgd",
    "local_sgd_step",
    "log_hparams",
    "log_metrics",
    "main_process_first",
    "make_scaler",
    "notebook_launch",
    "num_flops_per_token",
    "num_items_in_batch",
    "on_last_process",
    "on_local_main_process",
    "on_main_process",
    "on_process",
    "optimizer_step",
    "pad_across_processes",
    "pipeline_stages",
    "pipeline_step",
    "preemption",
    "profile",
    "progress",
    "reduce",
    "register_tracker",
    "remove_hooks",
    "run_on_main",
    "save_checkpoint",
    "save_model",
    "save_state",
    "scaled_backward",
    "set_rng_state",
    "set_seed",
    "shard_loader",
    "should_sync",
    "shutdown",
    "split_between_processes",
    "throughput_metrics",
    "unwrap_model",
    "wait_for_everyone",
    "wrap_model",
]
