"""Start and stop the process group, and coordinate processes.

`init_distributed` reads the launcher contract once (torchrun's variables, SLURM's when `srun`
started the processes without torchrun, or none for a plain `python` run), picks the device and
backend, creates the process group and returns a `RunContext` recording every choice.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, rendezvous  # type: ignore[attr-defined]

from accel import config as _config
from accel._exit import die_with_parent, register_exit_guard
from accel._groups import barrier, comm_device, named_collective, require_group
from accel._launcher import LaunchEnv, parse_launch_env
from accel._mesh import with_mesh
from accel._typing import Backend, Precision
from accel.context import Parallelism, RunContext, default_device
from accel.seeding import check_seed

__all__ = [
    "any_rank",
    "init_distributed",
    "main_process_first",
    "on_main_process",
    "run_on_main",
    "shutdown",
    "split_between_processes",
    "wait_for_everyone",
]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

_DEFAULT_TIMEOUT = timedelta(minutes=30)


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
    precision: Precision | None = None,
    grad_accum_steps: int | None = None,
    parallelism: Parallelism | None = None,
    backend: Backend | None = None,
    device: str | torch.device | None = None,
    timeout: float | timedelta | None = None,
    seed: int | None = None,
    config: str | os.PathLike[str] | _config.Config | None = None,
) -> RunContext:
    """Join the run this process was launched into and return its `RunContext`.

    Works under `accel launch` / torchrun, under SLURM's `srun`, and as a plain `python` process
    (world_size 1, no process group). Arguments override the launcher's `ACCEL_*` variables,
    which override the config file; `ctx.describe()` shows which won.

    Args:
        precision: "fp32", "bf16" or "fp16" autocast; None takes the launcher's or config's,
            else "fp32".
        grad_accum_steps: micro-batches per optimizer step; None takes the launcher's or
            config's, else 1.
        parallelism: the mesh sizes (data, fully-sharded, context and tensor parallel); the
            `DeviceMesh` is built when the world is split. None takes the launcher's or
            config's, else every rank is a replica.
        backend: "gloo" or "nccl"; by default nccl on CUDA, gloo otherwise.
        device: the device to use; by default this local rank's GPU, else mps, else cpu.
        timeout: seconds (or a timedelta) a collective may wait before it fails; default 30
            minutes.
        seed: base seed recorded in the context (seed the RNGs with `accel.set_seed`).
        config: a YAML config file (accel's or Accelerate's) or a `Config`; default None,
            the file named by `$ACCEL_CONFIG_FILE` if set, else none.

    Returns:
        The context to pass to every other accel call. Call `shutdown(ctx)` at the end.

    Raises:
        ValueError: for a bad `timeout`, a bad setting (argument, variable or config file),
            or a config file that does not parse.
        FileNotFoundError: for a config file that does not exist.
        RuntimeError: when a default process group already exists with another world size.

    Example:
        >>> ctx = init_distributed(device="cpu")  # a plain python process
        >>> ctx.world_size, ctx.process_group is None
        (1, True)
    """
    wait = _as_timeout(timeout)
    check_seed("init_distributed", seed)
    launch = parse_launch_env(os.environ)
    if parallelism is not None and not isinstance(parallelism, Parallelism):
        raise TypeError(
            f"init_distributed: parallelism={parallelism!r} must be an accel.Parallelism, e.g. "
            "Parallelism(dp_shard=2, tp=2)."
        )
    arguments = {
        "precision": precision, "grad_accum_steps": grad_accum_steps, "seed": seed,
        "device": device, "parallelism": parallelism,
    }  # fmt: skip
    settings = _config.resolve_settings(arguments, os.environ, config)
    if "device" in settings:
        chosen = torch.device(settings["device"][0])
    else:
        chosen = default_device(launch.local_rank)
        settings["device"] = (chosen, "default")
    if chosen.type == "cuda":
        # The one torch-wide switch accel flips: NCCL and autocast use the current device.
        torch.cuda.set_device(chosen)
    backend_source = "argument" if backend is not None else "default"
    if launch.world_size > 1:
        if backend is None:
            backend = "nccl" if chosen.type == "cuda" else "gloo"
        _connect(launch, backend, wait)
    sources = {name: source for name, (_, source) in settings.items()}
    topology_source = "default" if launch.launcher == "none" else f"launcher {launch.launcher}"
    for name in ("rank", "local_rank", "world_size", "local_world_size", "node_rank", "num_nodes"):
        sources[name] = topology_source
    sources |= {
        "backend": backend_source,
        "timeout": "argument" if timeout is not None else "default",
        "process_group": "default group" if launch.world_size > 1 else "default",
    }
    ctx = RunContext(
        rank=launch.rank,
        local_rank=launch.local_rank,
        world_size=launch.world_size,
        local_world_size=launch.local_world_size,
        node_rank=launch.node_rank,
        num_nodes=launch.num_nodes,
        device=chosen,
        backend=backend if launch.world_size > 1 else None,
        precision=settings["precision"][0],
        grad_accum_steps=settings["grad_accum_steps"][0],
        seed=settings["seed"][0],
        timeout=wait,
        fsdp=settings.get("fsdp", (None, ""))[0],
        compile=settings.get("compile", (False, ""))[0],
        log_with=settings.get("log_with", ((), ""))[0],
        sources=sources,
    )
    if "parallelism" not in settings:
        return ctx
    chosen_sizes, source = settings["parallelism"]
    return with_mesh(ctx, chosen_sizes, source=source)


def _connect(launch: LaunchEnv, backend: str, timeout: timedelta) -> None:
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
        return
    if launch.launcher == "torchrun":
        die_with_parent()
        # env:// honours torchrun's agent store. Workers restarted by the elastic agent
        # (--max_restarts) reuse that store, where the previous attempt's gloo addresses are
        # still written under the same keys; a prefix per attempt keeps them apart.
        store, _, _ = next(
            rendezvous("env://", rank=launch.rank, world_size=launch.world_size, timeout=timeout)
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            backend,
            store=PrefixStore(f"accel/attempt-{attempt}/", store),
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timeout,
        )
    else:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timeout,
        )
    # A script that never calls shutdown() would otherwise destroy the group during interpreter
    # finalization, which can abort the process; destroying it is local to this process. Exit
    # hooks run last-registered first: the group is destroyed, then gloo's threads drained.
    register_exit_guard()
    atexit.register(_destroy_default_group)


def _destroy_default_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def shutdown(ctx: RunContext) -> None:
    """Destroy the context's process group: the default group unless it names a sub-group.

    A no-op for a one-process context without a group (`init_distributed` in a plain `python`
    process), and when torch has no group initialised any more; a one-rank group
    (`run_world(fn, world_size=1)`) is destroyed too. Call it on every rank at the end of a run.

    Args:
        ctx: the context `init_distributed` returned (or one naming a sub-group to destroy).

    Example:
        >>> shutdown(init_distributed(device="cpu"))
    """
    has_group = ctx.world_size > 1 or ctx.backend is not None or ctx.process_group is not None
    if has_group and dist.is_initialized():
        dist.destroy_process_group(ctx.process_group)


def wait_for_everyone(ctx: RunContext) -> None:
    """Block until every rank of the context reaches this call (a barrier).

    Returns at once on one process.

    Args:
        ctx: the run context; waits for the ranks of `ctx.process_group`.

    Raises:
        RuntimeError: when `world_size > 1` and no process group is initialised, or the
            collective fails or times out (another rank did not make the same call).

    Example:
        >>> wait_for_everyone(RunContext())
    """
    barrier(ctx, "wait_for_everyone")


@contextlib.contextmanager
def main_process_first(ctx: RunContext) -> Iterator[None]:
    """Run the body on rank 0 first, then on the other ranks (e.g. download, then read cache).

    The other ranks wait at a barrier until rank 0 leaves the block, also when rank 0's body
    raises. Enter it on every rank.

    Args:
        ctx: the run context; `ctx.is_main` goes first.

    Yields:
        None; put the work inside the block.

    Raises:
        RuntimeError: when `world_size > 1` and no process group is initialised, or the
            collective fails or times out (another rank did not make the same call).

    Example:
        >>> with main_process_first(RunContext()):
        ...     pass
    """
    if not ctx.is_main:
        wait_for_everyone(ctx)
    try:
        yield
    finally:
        # Release the others even when rank 0's body raised, so they fail fast instead of
        # waiting out the collective timeout.
        if ctx.is_main:
            wait_for_everyone(ctx)


def on_main_process(ctx: RunContext) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Decorate a function so it runs on rank 0 only; elsewhere it returns None.

    Nothing is synchronised: other ranks go on at once.

    Args:
        ctx: the run context; the function runs where `ctx.is_main`.

    Returns:
        A decorator; the function it returns calls the decorated one on the main process and
        returns its result there, and returns None on other ranks without calling it.

    Example:
        >>> @on_main_process(RunContext())
        ... def hello() -> str:
        ...     return "hi"
        >>> hello()
        'hi'
    """

    def decorate(fn: Callable[P, R]) -> Callable[P, R | None]:
        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
            return fn(*args, **kwargs) if ctx.is_main else None

        return wrapper

    return decorate


def run_on_main(ctx: RunContext, fn: Callable[..., R], *args: Any) -> R | None:
    """Call `fn(*args)` on rank 0 and return its result there; other ranks get None.

    Nothing is synchronised: other ranks go on at once.

    Args:
        ctx: the run context; `fn` runs where `ctx.is_main`.
        fn: the function to call.
        *args: the positional arguments to call it with.

    Returns:
        What `fn` returned, on the main process; None on other ranks.

    Example:
        >>> run_on_main(RunContext(), max, 1, 2)
        2
    """
    return fn(*args) if ctx.is_main else None


def any_rank(ctx: RunContext, flag: bool) -> bool:
    """Return True on every rank if `flag` is true on any rank (e.g. to stop early together).

    Call it on every rank.

    Args:
        ctx: the run context; the flags are combined over `ctx.process_group`.
        flag: this rank's flag.

    Returns:
        True when any rank passed a true `flag`, the same on every rank.

    Raises:
        RuntimeError: when `world_size > 1` and no process group is initialised, or the
            collective fails or times out (another rank did not make the same call).

    Example:
        >>> any_rank(RunContext(), False)
        False
    """
    if ctx.world_size == 1:
        return bool(flag)
    group = require_group(ctx, "any_rank")
    value = torch.tensor([int(bool(flag))], device=comm_device(ctx))
    with named_collective(ctx, "any_rank"):
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def split_between_processes(ctx: RunContext, items: T, *, pad: bool = False) -> T:
    """Return this rank's contiguous share of `items` (a list, tuple, tensor or dict of them).

    Shares differ by at most one element, the first ranks taking the extra ones, as in
    Accelerate. With `pad=True` the shorter shares repeat their last element so every rank gets
    the same length (drop the padding after gathering). Nothing needs undoing afterwards, so
    Accelerate's `with accelerator.split_between_processes(x) as part:` becomes
    `part = split_between_processes(ctx, x)`. No communication happens: each rank slices its
    own copy, so every rank must pass the same items.

    Args:
        ctx: the run context; its rank and world size pick the share.
        items: a list, tuple or tensor (split along dim 0), or a dict of them, all of one
            length.
        pad: repeat the last element of a shorter share so every rank gets the same length;
            default False.

    Returns:
        This rank's share, of the same type as `items` (a dict holds each value's share).

    Raises:
        ValueError: for a dict whose values have different lengths.
        TypeError: for items that are not a list, tuple, tensor or dict of them (a string
            too).

    Example:
        >>> ctx = RunContext(rank=1, world_size=2)
        >>> split_between_processes(ctx, ["a", "b", "c"])
        ['c']
        >>> split_between_processes(ctx, ["a", "b", "c"], pad=True)
        ['c', 'c']
        >>> split_between_processes(ctx, {"x": [1, 2, 3, 4]})
        {'x': [3, 4]}
    """
    if isinstance(items, Mapping):
        lengths = {len(v) for v in items.values()}
        if len(lengths) > 1:
            raise ValueError(
                "split_between_processes: the values of the dict have different lengths "
                f"{sorted(lengths)}; every value must have the same length to be split together."
            )
        return type(items)({k: _share(ctx, v, pad) for k, v in items.items()})  # type: ignore[call-arg]
    if not isinstance(items, (Sequence, torch.Tensor)) or isinstance(items, (str, bytes)):
        raise TypeError(
            f"split_between_processes: items is a {type(items).__name__}; expected a list, "
            "tuple, tensor or a dict of those."
        )
    return _share(ctx, items, pad)  # type: ignore[no-any-return]


def _share(ctx: RunContext, items: Any, pad: bool) -> Any:
    total = len(items)
    base, extra = divmod(total, ctx.world_size)
    start = ctx.rank * base + min(ctx.rank, extra)
    stop = start + base + (1 if ctx.rank < extra else 0)
    part = items[start:stop]
    longest = base + (1 if extra else 0)
    if not pad or len(part) == longest or total == 0:
        return part
    missing = longest - len(part)
    last = items[-1:] if len(part) == 0 else part[-1:]
    if isinstance(part, torch.Tensor):
        return torch.cat([part, last.expand(missing, *last.shape[1:])])
    return part + type(part)(last) * missing
