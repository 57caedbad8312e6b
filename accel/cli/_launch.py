"""`accel launch`: start a script on every process of the run through torch.distributed.run.

accel only translates its flags and config file (accel's or Accelerate's YAML) into torchrun's
arguments and a few `ACCEL_*` variables for the workers; torchrun's elastic agent does the
spawning, restarts and rendezvous.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import socket
import sys
from pathlib import Path
from types import MappingProxyType
from typing import Any

from accel import _accelerate_config, _env_vars
from accel import config as _config
from accel.cli._accelerate_env import accelerate_environment
from accel.cli._args import add_flag

# Flags that override a config key of the same name, and their types.
_OVERRIDES: tuple[tuple[str, Any, str], ...] = (
    ("num_processes", int, "processes in total, over all machines"),
    ("num_machines", int, "machines taking part"),
    ("machine_rank", int, "this machine's index"),
    ("main_process_ip", str, "address of machine 0 (the rendezvous host)"),
    ("main_process_port", int, "rendezvous port; 0 picks a free one (one machine only)"),
    ("rdzv_backend", str, "torchrun rendezvous backend: static or c10d"),
    ("max_restarts", int, "how often the elastic agent restarts failed workers"),
    ("monitor_interval", float, "seconds between the agent's checks on its workers"),
    ("mixed_precision", str, "fp32 (or Accelerate's 'no'), bf16 or fp16"),
    ("gradient_accumulation_steps", int, "micro-batches per optimizer step"),
    ("num_cpu_threads_per_process", int, "OMP/torch threads per process"),
    ("gpu_ids", str, "comma-separated GPU ids to use, or 'all'"),
    ("seed", int, "base seed recorded in every process's RunContext"),
    ("log_with", str, "trackers init_trackers builds by default, e.g. wandb,mlflow"),
)

# Set for torchrun's agent. By default its c10d rendezvous shares one TCPStore with the workers
# for the whole job, so after a restart (--max_restarts) the new workers can read the keys the
# previous attempt's workers left there (gloo/nccl peer addresses) and connect to dead peers;
# this has been seen to hang or fail a restart. With sharing off, rank 0's worker hosts a fresh
# store every attempt. https://github.com/pytorch/pytorch/issues/135712
_AGENT_ENVIRONMENT = MappingProxyType({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "launch",
        help="run a script on every process of the run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flag(parser, "config_file", default=None, help="YAML config (accel's or Accelerate's)")
    for name, kind, text in _OVERRIDES:
        add_flag(parser, name, type=kind, default=None, help=text)
    parser.add_argument(
        "--grad_accum_steps", "--grad-accum-steps", dest="gradient_accumulation_steps",
        type=int, help=argparse.SUPPRESS,
    )  # fmt: skip
    add_flag(parser, "use_cpu", action="store_true", default=None, help="ignore GPUs")
    _add_parallel_flags(parser)
    add_flag(parser, "log_dir", default=None, help="write each worker's output under this folder")
    add_flag(
        parser, "tee", default=None, choices=("0", "1", "2", "3"),
        help="also copy workers' output into --log_dir: 0 none, 1 stdout, 2 stderr, 3 both",
    )  # fmt: skip
    parser.add_argument("-m", "--module", action="store_true", help="run script as a module")
    parser.add_argument("script", help="the training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")
    parser.set_defaults(run=run)


# Flags that fill Accelerate's nested sections, spelled as its `accelerate launch` flags.
_SECTION_FLAGS = (
    ("fsdp_config", _accelerate_config.FSDP_KEYS),
    ("parallelism_config", _accelerate_config.PARALLELISM_KEYS),
    ("dynamo_config", _accelerate_config.DYNAMO_KEYS),
)


def _add_parallel_flags(parser: argparse.ArgumentParser) -> None:
    for section, keys in _SECTION_FLAGS:
        for key in keys:
            add_flag(parser, key, default=None, help=f"Accelerate's {section} key {key}")
    add_flag(parser, "tp_size", type=int, default=None, help="tensor-parallel size")
    add_flag(parser, "use_fsdp", action="store_true", default=None, help="shard with FSDP2")
    add_flag(
        parser, "use_parallelism_config", action="store_true", default=None,
        help="accepted for Accelerate; the parallelism_config_* flags set the mesh",
    )  # fmt: skip
    add_flag(parser, "multi_gpu", action="store_true", default=None, help="distributed on GPUs")
    add_flag(parser, "cpu", action="store_true", default=None, help="same as --use_cpu")


def _merge_parallel_flags(args: argparse.Namespace, merged: dict[str, Any]) -> None:
    flag = functools.partial(getattr, args)  # `accel test` shares resolve_config, not the flags
    if flag("use_fsdp", None):
        merged["distributed_type"] = "FSDP"
    elif flag("multi_gpu", None):
        merged["distributed_type"] = "MULTI_GPU"
    if flag("cpu", None):
        merged["use_cpu"] = True
    overrides = {"parallelism_config_tp_size": flag("tp_size", None)}
    for section, keys in _SECTION_FLAGS:
        values = dict(merged.get(section) or ())
        for key in keys:
            value = flag(key, None) if overrides.get(key) is None else overrides[key]
            if value is not None:
                values[key] = value
        merged[section] = values


def resolve_config(args: argparse.Namespace) -> _config.Config:
    """Merge the config file (explicit, else the default path if present) and the flags."""
    path = args.config_file
    if path is None and _config.default_config_path().is_file():
        path = _config.default_config_path()
    elif path is None and _config.accelerate_config_path().is_file():
        path = _config.accelerate_config_path()  # a migrating user's `accelerate config` output
    base = _config.load_config(path) if path is not None else _config.Config()
    merged = dataclasses.asdict(base)
    for name, *_ in _OVERRIDES:
        if getattr(args, name) is not None:
            merged[name] = getattr(args, name)
    if args.use_cpu:
        merged["use_cpu"] = True
    _merge_parallel_flags(args, merged)
    return _config.parse_config(merged, origin="accel launch")


def torchrun_argv(config: _config.Config, args: argparse.Namespace) -> list[str]:
    """Translate a launch config into torchrun's command line."""
    machines, total = config.num_machines, config.num_processes
    if total % machines:
        raise ValueError(
            f"num_processes={total} is not divisible by num_machines={machines}; "
            "num_processes counts processes over all machines (as in Accelerate's config)."
        )
    argv = [
        "--nnodes", str(machines), "--nproc-per-node", str(total // machines),
        "--max-restarts", str(config.max_restarts),
        "--monitor-interval", str(config.monitor_interval),
    ]  # fmt: skip
    port = config.main_process_port
    if machines == 1 and config.max_restarts:
        # c10d rendezvous, where each restarted attempt gets a fresh store (_AGENT_ENVIRONMENT).
        if port:
            _check_port_free(port)
            endpoint = f"{config.main_process_ip or '127.0.0.1'}:{port}"
            argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
        else:
            argv.append("--standalone")  # c10d rendezvous on localhost:0, a free port
    elif machines == 1:
        # Nothing to restart: torchrun's static rendezvous, which starts faster than c10d's
        # (no join protocol with its random start delay and polling), on the given port or a
        # free one.
        if port:
            _check_port_free(port)
        else:
            port = _free_port()
        argv += ["--master-addr", config.main_process_ip or "127.0.0.1", "--master-port", str(port)]
    else:
        if not config.main_process_ip or not port:
            raise ValueError(
                f"num_machines={machines} needs --main_process_ip and a non-zero "
                "--main_process_port that every machine can reach (machine 0's address)."
            )
        if config.rdzv_backend == "static":
            if config.machine_rank == 0:
                _check_port_free(port)
            argv += [
                "--node-rank", str(config.machine_rank),
                "--master-addr", config.main_process_ip, "--master-port", str(port),
            ]  # fmt: skip
        else:
            endpoint = f"{config.main_process_ip}:{port}"
            argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
            argv += ["--rdzv-id", f"accel-{endpoint}"]
    if args.log_dir:
        if Path(args.log_dir).exists() and not Path(args.log_dir).is_dir():
            raise ValueError(
                f"log_dir={args.log_dir!r} is a file, not a folder; pass a folder for the "
                "workers' logs (it is created if missing)."
            )
        argv += ["--log-dir", args.log_dir]
    if args.tee:
        argv += ["--tee", args.tee]
    if args.module:
        argv.append("--module")
    elif not Path(args.script).is_file():
        raise FileNotFoundError(f"script={args.script!r} does not exist.")
    return [*argv, args.script, *args.script_args]


def _free_port() -> int:
    # The OS picks a port that is free now; torchrun's agent binds it a moment later.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


def _check_port_free(port: int | None) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("", int(port or 0)))
        except OSError:
            raise ValueError(
                f"main_process_port={port} is in use on this machine; pass another port, or "
                "--main_process_port 0 on a single machine to pick a free one."
            ) from None


def worker_environment(config: _config.Config) -> dict[str, str]:
    """The variables that carry the settings to `init_distributed` in each worker."""
    env = {
        _env_vars.ENV_PRECISION: config.mixed_precision,
        _env_vars.ENV_GRAD_ACCUM: str(config.gradient_accumulation_steps),
    }
    if config.seed is not None:
        env[_env_vars.ENV_SEED] = str(config.seed)
    if config.use_cpu:
        env[_env_vars.ENV_DEVICE] = "cpu"
    if config.gpu_ids not in (None, "all"):
        env["CUDA_VISIBLE_DEVICES"] = str(config.gpu_ids)
    if config.num_cpu_threads_per_process is not None:
        env["OMP_NUM_THREADS"] = str(config.num_cpu_threads_per_process)
    settings = _config.config_settings(config, "launch")
    if "parallelism" in settings:
        sizes = settings["parallelism"][0]
        env |= {var: str(getattr(sizes, dim)) for dim, var in _env_vars.ENV_MESH.items()}
    if "fsdp" in settings:
        env |= _env_vars.fsdp_environment(settings["fsdp"][0])
    if "compile" in settings:
        env[_env_vars.ENV_COMPILE] = str(settings["compile"][0]).lower()
    if config.log_with:
        env[_env_vars.ENV_LOG_WITH] = ",".join(config.log_with)
    return env


def run(args: argparse.Namespace) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    config = resolve_config(args)
    argv = torchrun_argv(config, args)
    # This is the launcher process, not library code: the workers inherit its environment,
    # which is the documented channel to init_distributed (see accel.config).
    os.environ.update({**worker_environment(config), **_AGENT_ENVIRONMENT})
    # The same settings for code built on Accelerate (transformers' Trainer), as its launcher
    # exports them; what cannot reach such code is said here, once.
    accelerate_env, unreachable = accelerate_environment(config)
    os.environ.update(accelerate_env)
    for line in unreachable:
        print(f"accel launch: warning: {line}", file=sys.stderr)
    try:
        torchrun.run(torchrun.parse_args(argv))  # type: ignore[no-untyped-call]
    except ChildFailedError as err:
        print(f"accel launch: the script failed.\n{err}", file=sys.stderr)
        return 1
    return 0
