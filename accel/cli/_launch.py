"""`accel launch`: start a script on every process of the run through torch.distributed.run.

accel only translates its flags and config file (accel's or Accelerate's YAML) into torchrun's
arguments and a few `ACCEL_*` variables for the workers; torchrun's elastic agent does the
spawning, restarts and rendezvous.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from accel import config as _config
from accel._rerun import PREEMPTED_EXIT_CODE
from accel._settings.table import build, environment
from accel.cli import _preflight, _signals
from accel.cli._accelerate_env import accelerate_environment
from accel.cli._script import check_script, misplaced_flags, uses_trainer
from accel_settings import KEYS, SECTIONS, Setting

# Set for torchrun's agent. By default its c10d rendezvous shares one TCPStore with the workers
# for the whole job, so after a restart (--max_restarts) the new workers can read the keys the
# previous attempt's workers left there (gloo/nccl peer addresses) and connect to dead peers;
# this has been seen to hang or fail a restart. With sharing off, rank 0's worker hosts a fresh
# store every attempt. https://github.com/pytorch/pytorch/issues/135712
_AGENT_ENVIRONMENT = MappingProxyType({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})


def _flag(args: argparse.Namespace, setting: Setting) -> Any:
    """A setting's flag, or one of its other names (--tp_size), or None when not given."""
    for name in (*setting.flags, str(setting.key)):  # as before the table, the short name wins
        value = getattr(args, name, None)  # `accel test` shares resolve_config, not the flags
        if value is not None:
            return value
    return None


def _merge_parallel_flags(args: argparse.Namespace, merged: dict[str, Any]) -> None:
    flag = functools.partial(getattr, args)
    if flag("use_fsdp", None):
        merged["distributed_type"] = "FSDP"
    elif flag("use_deepspeed", None):
        merged["distributed_type"] = "DEEPSPEED"
    elif flag("multi_gpu", None):
        merged["distributed_type"] = "MULTI_GPU"
    for name, section in SECTIONS.items():
        values = dict(merged.get(name) or ())
        for setting in section.settings:
            if setting.key is not None and setting.flag and _flag(args, setting) is not None:
                values[setting.key] = _flag(args, setting)
        merged[name] = values


def resolve_config(args: argparse.Namespace) -> _config.Config:
    """Merge the config file (explicit, else the default path if present) and the flags."""
    return resolve_launch(args)[0]


def resolve_launch(args: argparse.Namespace) -> tuple[_config.Config, dict[str, Any]]:
    """The launch config (the config file, explicit, else the default path if present, and the
    flags over it) and the RunContext values it gives the workers, each read once, here."""
    path = _config.config_in_force(args.config_file)  # else Accelerate's file, else none
    merged: dict[str, Any] = {}
    if path is not None:  # its keys checked naming the file; its values with the flags'
        merged = dataclasses.asdict(_config.parse_keys(_config.read_yaml(path), str(path)))
    for name, setting in KEYS.items():
        if _flag(args, setting) is not None:
            merged[name] = _flag(args, setting)
    _merge_parallel_flags(args, merged)
    return _config.read_launch(merged, origin="accel launch")


def _check_shutdown_timeout(seconds: int) -> int:
    """The grace period, where this torch's torchrun takes one (torch 2.12 added it)."""
    import torch
    from torch.distributed.launcher.api import LaunchConfig

    if "shutdown_timeout" not in {f.name for f in dataclasses.fields(LaunchConfig)}:
        raise ValueError(
            f"shutdown_timeout={seconds} needs torch 2.12 or newer, whose torchrun takes a grace "
            f"period; torch {torch.__version__}'s waits 30 s. Upgrade torch, or drop "
            "--shutdown_timeout (shutdown_timeout in the config)."
        )
    return seconds


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
    if config.shutdown_timeout is not None:
        argv += ["--shutdown-timeout", str(_check_shutdown_timeout(config.shutdown_timeout))]
    port = config.main_process_port
    c10d = config.rdzv_backend == "c10d" if machines > 1 else config.max_restarts > 0
    if config.rdzv_conf and not c10d:
        raise ValueError(
            f"rdzv_conf={config.rdzv_conf!r} configures the c10d rendezvous, which this launch "
            "does not use; pass --rdzv_backend c10d (several machines) or --max_restarts N (one "
            "machine), or drop --rdzv_conf."
        )
    if config.rdzv_conf:
        argv += ["--rdzv-conf", config.rdzv_conf]
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
        # The port is checked by the preflight (accel/cli/_preflight.py), which binds it on
        # machine 0 first and tells a second machine_rank 0 from another program there.
        if config.rdzv_backend == "static":
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
    if not args.module and not Path(args.script).is_file():
        raise FileNotFoundError(
            f"script={args.script!r} does not exist in {os.getcwd()}; pass the path of the "
            "training script (or -m with a module name)."
        )
    # Each worker runs the script through accel_cli._worker, which records an uncaught
    # exception for failure_summary (and otherwise runs it as `python script.py` would).
    script = ["-m", args.script] if args.module else [args.script]
    return [*argv, "--module", "accel_cli._worker", *script, *args.script_args]


def _free_port() -> int:
    # The OS picks a port that is free now; torchrun's agent binds it a moment later.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


def _check_port_free(port: int | None) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As torch's TCPStore binds its server socket: the connections of the run that just
        # ended on this port linger in TIME_WAIT for a minute, which stops a plain bind but
        # not the store's; only a socket that listens there now makes the port busy.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", int(port or 0)))
        except OSError:
            raise ValueError(
                f"main_process_port={port} is in use on this machine; pass another port, or "
                "--main_process_port 0 on a single machine to pick a free one."
            ) from None


def worker_environment(
    config: _config.Config, settings: Mapping[str, Any] | None = None
) -> dict[str, str]:
    """The variables that carry the settings (`resolve_launch`'s, else `config`'s, read here)
    to `init_distributed` in each worker."""
    return environment(build(config) if settings is None else settings, config)


# What torchrun's agent logs while it stops the workers on a signal (Ctrl-C, a scheduler's
# SIGTERM): one line per worker and one for itself, where `run` says it once.
_SHUTDOWN_LOGS = MappingProxyType(
    {
        "torch.distributed.elastic.agent.server.api": (
            "Received %s death signal, shutting down workers"
        ),
        "torch.distributed.elastic.multiprocessing.api": "Sending process %s closing signal %s",
    }
)


# ... and what it logs when a worker exits non-zero, which after a pre-emption (exit code 138 on
# every worker) is the plan, said by the launcher's own line.
_FAILED_LOG = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"


def _drop_shutdown_log(record: logging.LogRecord) -> bool:
    if record.msg == _FAILED_LOG and isinstance(record.args, tuple) and record.args:
        return record.args[0] != PREEMPTED_EXIT_CODE
    return record.msg != _SHUTDOWN_LOGS.get(record.name)


@contextlib.contextmanager
def _quiet_shutdown() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _SHUTDOWN_LOGS]
    for logger in loggers:
        logger.addFilter(_drop_shutdown_log)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(_drop_shutdown_log)


def run(args: argparse.Namespace) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    config, settings = resolve_launch(args)  # every setting read once, here
    _config.check_launch_environment(config, settings)
    argv = torchrun_argv(config, args)
    check_script(args.script, module=args.module)  # one line here, not one error per worker
    _warn_misplaced_flags(args)
    if config.num_machines > 1:  # every machine against the others, before anything waits
        failures = _preflight.preflight(config)
        if failures:
            print("\n".join(failures), file=sys.stderr)
            return 1
    # This is the launcher process, not library code: the workers inherit its environment,
    # which is the documented channel to init_distributed (see accel.config).
    os.environ.update({**worker_environment(config, settings), **_AGENT_ENVIRONMENT})
    for key, value in _signals.agent_environment().items():
        os.environ.setdefault(key, value)
    if config.num_processes // config.num_machines > 1:
        # torchrun's own default for several processes a machine, set here so that its 4-line
        # banner announcing it does not head every launch (docs/cli.md says it once).
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The same settings for code built on Accelerate (transformers' Trainer), as its launcher
    # exports them; what cannot reach such code is said here, once.
    trainer = uses_trainer(args.script, module=args.module)
    accelerate_env, unreachable = accelerate_environment(
        config, trainer=trainer, has_gpu=_has_gpu()
    )
    os.environ.update(accelerate_env)
    for line in unreachable:
        print(f"accel launch: warning: {line}", file=sys.stderr)
    try:
        with _quiet_shutdown():
            torchrun.run(torchrun.parse_args(argv))  # type: ignore[no-untyped-call]
    except ChildFailedError as err:
        codes = {rank: failure.exitcode for rank, failure in err.failures.items()}
        stopped = _signals.preempted_line(codes, "a pre-emption stopped the run")
        if stopped is not None:  # this machine was not signalled; another one was
            print(stopped, file=sys.stderr)
            return PREEMPTED_EXIT_CODE
        print(failure_summary(err.failures), file=sys.stderr)
        return 1
    except SignalException as err:  # a scheduler's stop signal, forwarded to the workers
        return _signals.exit_after_signal(err)
    except RendezvousTimeoutError:
        print(rendezvous_timeout_line(config, argv), file=sys.stderr)
        return 1
    return 0


def _warn_misplaced_flags(args: argparse.Namespace) -> None:
    """Say so where one of the launcher's flags came after the script, which does not read it:
    everything after the script is the script's, so it did not reach the launcher."""
    if not any(arg.startswith("--") for arg in args.script_args):
        return  # the common case: no flag to compare, no parser built
    found = misplaced_flags(
        args.script, module=args.module, script_args=args.script_args,
        launcher_flags=args.launcher_flags,
    )  # fmt: skip
    for flag in found:
        print(
            f"accel launch: warning: {flag} comes after the script, so it is the script's "
            f"argument (and {args.script} does not read it), not accel launch's; put accel "
            f"launch's flags before the script: accel launch {flag} ... {args.script}",
            file=sys.stderr,
        )


def _has_gpu() -> bool:
    """Whether the workers will find a CUDA device (torch's NVML count: no CUDA context here)."""
    import torch

    return torch.cuda.device_count() > 0


def rendezvous_timeout_line(config: _config.Config, argv: list[str]) -> str:
    """The one line for a c10d rendezvous that timed out: a machine never arrived."""
    endpoint = argv[argv.index("--rdzv-endpoint") + 1] if "--rdzv-endpoint" in argv else "?"
    conf = dict(p.split("=", 1) for p in (config.rdzv_conf or "").split(",") if p)
    seconds = conf.get("join_timeout", "600")  # torch's default (dynamic_rendezvous.py)
    return (
        f"accel launch: the c10d rendezvous at {endpoint} timed out after {seconds} s "
        f"(join_timeout) before all {config.num_machines} machines joined; start `accel launch "
        f"--machine_rank R` on every other machine with the same --main_process_ip and "
        f"--main_process_port, check they reach {endpoint}, or wait longer with --rdzv_conf "
        "join_timeout=SECONDS."
    )


def failure_summary(failures: Mapping[int, Any]) -> str:
    """Which ranks failed, then (the last line) the rank that failed first and its exception.

    `failures` are torchrun's `ProcessFailure`s by global rank. A rank that raised carries the
    record accel_cli._worker wrote, timed to the nanosecond; ranks that only exited (or were
    stopped by the agent once another failed) are ordered by when the agent saw them.
    """

    def record(failure: Any) -> dict[str, Any] | None:
        data = failure.error_file_data.get("accel") if failure.error_file_data else None
        return data if isinstance(data, dict) else None

    def exit_text(code: int) -> str:
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    raised = {rank: f for rank, f in failures.items() if record(f) is not None}
    exited = {rank: f for rank, f in failures.items() if f.exitcode > 0}
    candidates = raised or exited or dict(failures)
    rank, first = min(
        candidates.items(),
        key=lambda item: (record(item[1]) or {}).get("time_ns", item[1].timestamp * 10**9),
    )
    what = record(first)["summary"] if rank in raised else exit_text(first.exitcode)  # type: ignore[index]
    ranks = ", ".join(f"{r} ({exit_text(f.exitcode)})" for r, f in sorted(failures.items()))
    plural = "s" if len(failures) > 1 else ""
    return (
        f"accel launch: the script failed on rank{plural} {ranks}; its output is above.\n"
        f"accel launch: rank {rank} failed first: {what}"
    )
