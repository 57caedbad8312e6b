"""Start and stop the process group; `accel.process_control` coordinates the processes.

`init_distributed` reads the launcher contract once (torchrun's variables, SLURM's when `srun`
started the processes without torchrun, or none for a plain `python` run), picks the device and
backend, creates the process group and returns a `RunContext` recording every choice.
"""

from __future__ import annotations

import atexit
import math
import os
import threading
import warnings
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed import HashStore, PrefixStore, Store, rendezvous  # type: ignore[attr-defined]

from accel import config as _config
from accel._background import wait_for_saves
from accel._canary import canary_device, stand_for_nccl
from accel._device import default_device, resolve_device
from accel._exit import die_with_parent, drain_gloo_workers, register_exit_guard
from accel._launcher import LaunchEnv, parse_launch_env
from accel._mesh import with_mesh
from accel._options import context_values
from accel._rerun import JOINED_GROUP, hold_signals, release_signals
from accel._typing import Backend, Precision
from accel.context import Parallelism, RunContext
from accel.seeding import check_seed

__all__ = ["init_distributed", "shutdown"]

_DEFAULT_TIMEOUT = timedelta(minutes=30)
# Settings init_distributed applies itself rather than passing them to RunContext as they are.
_OWN = frozenset({"device", "parallelism"})


_JOINED_GROUP = JOINED_GROUP


def _as_timeout(value: float | timedelta | None) -> timedelta:
    if value is None:
        return _DEFAULT_TIMEOUT
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not math.isfinite(seconds)
        or seconds <= 0
    ):
        raise ValueError(
            f"init_distributed: timeout={value!r} must be a positive number of seconds or a "
            "datetime.timedelta, e.g. timeout=600."
        )
    return timedelta(seconds=seconds)


def init_distributed(
    *,
    precision: Precision | Literal["no"] | None = None,
    grad_accum_steps: int | None = None,
    parallelism: Parallelism | None = None,
    backend: Backend | None = None,
    device: str | torch.device | int | None = None,
    timeout: float | timedelta | None = None,
    seed: int | None = None,
    config: str | os.PathLike[str] | _config.Config | None = None,
) -> RunContext:
    """Join the run this process was launched into and return its `RunContext`.

    Works under `accel launch` / torchrun, under SLURM's `srun`, and as a plain `python` process
    (world_size 1, no process group). Arguments override the launcher's `ACCEL_*` variables,
    which override the config file; `ctx.describe()` shows which won.

    Under a launcher, from its first line on, a SIGTERM or SIGUSR1 (a scheduler's pre-emption
    during start-up) is held for the loop's `accel.preemption` block, which stops at its first
    step; a second one ends the process as before. `shutdown` gives them back.

    Args:
        precision: "fp32", "bf16" or "fp16" autocast, or "fp8" (float8 Linear layers
            through `wrap_model`; "no", Accelerate's spelling, is "fp32"); None takes the
            launcher's or config's, else "fp32".
        grad_accum_steps: micro-batches per optimizer step; None takes the launcher's or
            config's, else 1.
        parallelism: the mesh sizes (data, fully-sharded, context and tensor parallel); the
            `DeviceMesh` is built when the world is split. None takes the launcher's or
            config's, else every rank is a replica.
        backend: "gloo" or "nccl"; by default nccl on CUDA, gloo otherwise. A one-process
            run gets a (one-rank) process group only when `backend` is given.
        device: the device to use, as torch reads it: "cuda" or `torch.device("cuda")` is
            this rank's own GPU (its local rank's), "cuda:N", `torch.device("cuda", N)` or the
            int N is GPU N, "cpu" and "mps" are those. By default this local rank's GPU, else
            mps, else cpu.
        timeout: seconds (or a timedelta) a collective may wait before it fails; default 30
            minutes.
        seed: base seed recorded in the context (seed the RNGs with `accel.set_seed`).
        config: a YAML config file (accel's or Accelerate's) or a `Config`; default None,
            the file named by `$ACCEL_CONFIG_FILE` if set, else none.

    Returns:
        The context to pass to every other accel call. Call `shutdown(ctx)` at the end.

    Raises:
        ValueError: for a bad `timeout`, a bad setting (argument, variable or config file),
            a GPU this machine lacks, or a config file that does not parse.
        FileNotFoundError: for a config file that does not exist.
        RuntimeError: when a default process group already exists with another world size.

    Example:
        >>> from accel import init_distributed
        >>> ctx = init_distributed(device="cpu")  # a plain python process
        >>> ctx.world_size, ctx.process_group is None
        (1, True)
    """
    wait = _as_timeout(timeout)
    check_seed("init_distributed", seed)
    launch = parse_launch_env(os.environ)
    if launch.launcher != "none" and threading.current_thread() is threading.main_thread():
        # From here on a scheduler's stop signal is held for the loop's accel.preemption block
        # rather than killing the process during start-up (accel/_rerun.py, HeldSignal).
        hold_signals()
    if parallelism is not None and not isinstance(parallelism, Parallelism):
        raise TypeError(
            f"init_distributed: parallelism={parallelism!r} must be an accel.Parallelism, e.g. "
            "Parallelism(dp_shard=2, tp=2)."
        )
    if precision == "no":  # Accelerator(mixed_precision="no")
        precision = "fp32"
    arguments = {
        "precision": precision, "grad_accum_steps": grad_accum_steps, "seed": seed,
        "device": device, "parallelism": parallelism,
    }  # fmt: skip
    settings = _config.resolve_settings(arguments, os.environ, config)
    if "device" in settings:
        spelling, source = settings["device"]
        chosen = resolve_device(
            spelling,
            local_rank=launch.local_rank,
            device_count=torch.cuda.device_count(),
            name="device" if source == "argument" else source.removeprefix("env "),
        )
        settings["device"] = (chosen, source)
    elif launch.device is not None:
        chosen = torch.device(launch.device)  # the launcher's (Ray's) choice, not a guess
        settings["device"] = (chosen, "launcher ACCELERATE_TORCH_DEVICE")
    else:
        chosen = default_device(launch.local_rank)
        settings["device"] = (chosen, "default")
    if chosen.type == "cuda":
        # The one torch-wide switch accel flips: NCCL and autocast use the current device.
        torch.cuda.set_device(chosen)
    backend_source = "argument" if backend is not None else "default"
    # One process gets a group only when it asks for a backend (a one-GPU run checking NCCL):
    # collectives of a one-rank world need none, and creating one costs a rendezvous.
    grouped = launch.world_size > 1 or backend is not None
    created = False
    if grouped:
        if backend is None:
            backend = "nccl" if chosen.type == "cuda" else "gloo"
            if chosen == canary_device():  # the canary's GPU: its group stands for NCCL
                stand_for_nccl()
        created = _connect(launch, backend, wait)
    sources = {name: source for name, (_, source) in settings.items()}
    topology_source = "default" if launch.launcher == "none" else f"launcher {launch.launcher}"
    for name in ("rank", "local_rank", "world_size", "local_world_size", "node_rank", "num_nodes"):
        sources[name] = topology_source
    sources |= {
        "backend": backend_source,
        "timeout": "argument" if timeout is not None else "default",
        "process_group": (
            ("default group" if created else _JOINED_GROUP) if grouped else "default"
        ),
    }
    ctx = RunContext(
        rank=launch.rank,
        local_rank=launch.local_rank,
        world_size=launch.world_size,
        local_world_size=launch.local_world_size,
        node_rank=launch.node_rank,
        num_nodes=launch.num_nodes,
        device=chosen,
        backend=backend if grouped else None,
        timeout=wait,
        sources=sources,
        # Every setting the table gave a value (precision, seed, wrap's...); the mesh is next.
        **context_values({n: v for n, (v, _) in settings.items() if n not in _OWN}),
    )
    if "parallelism" not in settings:
        return ctx
    chosen_sizes, source = settings["parallelism"]
    return with_mesh(ctx, chosen_sizes, source=source)


def _attempt_store(store: Store) -> Store:
    """torchrun's store for this attempt's default group, clear of earlier attempts' keys.

    By default torchrun's agent shares one store with the workers for the whole job (env://
    connects to it), so workers restarted by the agent (--max_restarts) would find the previous
    attempt's gloo addresses under the same keys: a prefix per attempt keeps them apart. That
    count is the machine's own, though: an agent that restarts its workers because another
    machine's failed does not count a restart, so across machines the counts differ and the
    ranks would wait under different prefixes. Shared, the store is safe on one machine only;
    with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (what `accel launch` sets) each attempt's rank 0
    hosts a fresh store, which needs no prefix.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return store
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    machines = os.environ.get("GROUP_WORLD_SIZE", "1")
    if int(machines) > 1 and int(restarts) > 0 and os.environ.get("RANK") == "0":
        warnings.warn(
            f"init_distributed: torchrun restarts workers (--max-restarts {restarts}) on "
            f"{machines} machines with one store shared for the whole job; with the c10d "
            "rendezvous a restarted attempt can wait forever on its peers. Start torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (accel launch sets it).",
            stacklevel=3,
        )
    return PrefixStore(f"accel/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


def _connect(launch: LaunchEnv, backend: str, timeout: timedelta) -> bool:
    """Create the default group, or join the one that exists; True when it created it."""
    # The context refers to the default group as process_group=None rather than holding it:
    # a gloo group still referenced when the interpreter finalizes can abort the process
    # (https://github.com/pytorch/pytorch/pull/179291), and a RunContext often lives that long.
    if dist.is_initialized():
        # The caller (or another framework) made the default group: join it rather than fail.
        if dist.get_world_size() != launch.world_size:
            raise RuntimeError(
                f"init_distributed: a process group of world_size={dist.get_world_size()} "
                f"already exists but the launcher says world_size={launch.world_size}."
            )
        return False
    if launch.launcher == "torchrun":
        die_with_parent()
        store, _, _ = next(
            rendezvous("env://", rank=launch.rank, world_size=launch.world_size, timeout=timeout)
        )
        dist.init_process_group(
            backend,
            store=_attempt_store(store),
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timeout,
        )
    elif launch.world_size == 1 and launch.master_port is None:
        # One process asked for a backend with no launcher to meet at: a store of its own.
        dist.init_process_group(backend, store=HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        try:
            dist.init_process_group(
                backend,
                init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
                rank=launch.rank,
                world_size=launch.world_size,
                timeout=timeout,
            )
        except dist.DistNetworkError as err:
            if "EADDRINUSE" not in str(err):
                raise
            # rank 0 hosts the rendezvous (a TCPStore) on the port srun or mpirun agreed on
            raise RuntimeError(
                f"init_distributed: the rendezvous port MASTER_PORT={launch.master_port} is in "
                f"use on {launch.master_addr} (another job, or a process of an earlier run); "
                "every rank must use the same free port: export another one as MASTER_PORT "
                "(srun: in the job's environment; mpirun: -x MASTER_PORT=PORT)."
            ) from None
    # A script that never calls shutdown() would otherwise destroy the group during interpreter
    # finalization, which can abort the process; destroying it is local to this process. Exit
    # hooks run last-registered first: the group is destroyed, then gloo's threads drained.
    register_exit_guard()
    atexit.register(_destroy_default_group)
    return True


def _destroy_default_group() -> None:
    if dist.is_initialized():
        drain_gloo_workers()  # see shutdown
        dist.destroy_process_group()


def shutdown(ctx: RunContext) -> None:
    """Destroy the context's process group: the default group unless it names a sub-group.

    First it waits for this process's background checkpoint saves (`save_checkpoint(...,
    blocking=False)`) and raises the error of one that failed and was not reported yet.

    A no-op for a one-process context without a group (`init_distributed` in a plain `python`
    process), for a default group `init_distributed` joined rather than created (Ray Train's:
    its creator destroys it), and when torch has no group initialised any more; a one-rank group
    (`run_world(fn, world_size=1)`) is destroyed too. Call it on every rank at the end of a run.

    Args:
        ctx: the context `init_distributed` returned (or one naming a sub-group to destroy).

    Example:
        >>> from accel import init_distributed, shutdown
        >>> shutdown(init_distributed(device="cpu"))
    """
    try:
        wait_for_saves("shutdown")  # a background checkpoint save finishes, or its error is raised
    finally:
        release_signals()  # the stop signals init_distributed held get their default action back
    has_group = ctx.world_size > 1 or ctx.backend is not None or ctx.process_group is not None
    if ctx.process_group is None and ctx.sources.get("process_group") == _JOINED_GROUP:
        return  # made by another framework (Ray Train), which destroys it itself
    if has_group and dist.is_initialized():
        # The group's destructor joins gloo's worker threads while this thread holds the GIL;
        # it runs here, or later when a DDP module still holding the group is freed (at a
        # function's return, at exit). A worker still releasing the last collective's tensors
        # needs the GIL: a deadlock, the process never exits. Let them finish first; after
        # this call no collective gives them new work.
        drain_gloo_workers()
        dist.destroy_process_group(ctx.process_group)
