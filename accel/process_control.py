"""Coordinate the processes of a run: barriers, ordered blocks, rank-gated calls, shares.

Every helper is a function of the `RunContext` alone (which rank, which node, which group), so
the rank-gated ones answer for any hand-built context without a process group, and each is the
obvious thing on one process.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed as dist

from accel._groups import barrier, comm_device, named_collective, require_group
from accel.context import RunContext

__all__ = [
    "any_rank",
    "local_main_process_first",
    "main_process_first",
    "on_last_process",
    "on_local_main_process",
    "on_main_process",
    "on_process",
    "run_on_main",
    "split_between_processes",
    "wait_for_everyone",
]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


def wait_for_everyone(ctx: RunContext) -> None:
    """Block until every rank of the context reaches this call (a barrier).

    Returns at once on one process.

    Args:
        ctx: the run context; waits for the ranks of `ctx.process_group`.

    Raises:
        RuntimeError: when `world_size > 1` and no process group is initialised, or the
            collective fails or times out (another rank did not make the same call).

    Example:
        >>> from accel import RunContext, wait_for_everyone
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
        >>> from accel import RunContext, main_process_first
        >>> with main_process_first(RunContext()):
        ...     pass
    """
    with _first(ctx, ctx.is_main):
        yield


@contextlib.contextmanager
def local_main_process_first(ctx: RunContext) -> Iterator[None]:
    """Run the body on local rank 0 of each machine first, then on the machine's other ranks.

    For work per machine (a download into a node-local cache): the other ranks wait at a
    barrier until every local main has left the block, also when one's body raises. Enter it on
    every rank.

    Args:
        ctx: the run context; `ctx.is_local_main` goes first.

    Yields:
        None; put the work inside the block.

    Raises:
        RuntimeError: when `world_size > 1` and no process group is initialised, or the
            collective fails or times out (another rank did not make the same call).

    Example:
        >>> from accel import RunContext, local_main_process_first
        >>> with local_main_process_first(RunContext()):
        ...     pass
    """
    with _first(ctx, ctx.is_local_main):
        yield


@contextlib.contextmanager
def _first(ctx: RunContext, goes_first: bool) -> Iterator[None]:
    if not goes_first:
        wait_for_everyone(ctx)
    try:
        yield
    finally:
        # Release the others even when a first rank's body raised, so they fail fast instead of
        # waiting out the collective timeout.
        if goes_first:
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
        >>> from accel import RunContext, on_main_process
        >>> @on_main_process(RunContext())
        ... def hello() -> str:
        ...     return "hi"
        >>> hello()
        'hi'
    """
    return _only_where(ctx.is_main)


def on_local_main_process(
    ctx: RunContext,
) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Decorate a function so it runs on local rank 0 of each machine only; elsewhere None.

    Nothing is synchronised: other ranks go on at once.

    Args:
        ctx: the run context; the function runs where `ctx.is_local_main`.

    Returns:
        A decorator; the function it returns calls the decorated one on each machine's local
        main process and returns its result there, and returns None elsewhere without calling
        it.

    Example:
        >>> from accel import RunContext, on_local_main_process
        >>> ctx = RunContext(rank=2, local_rank=0, world_size=4, local_world_size=2)
        >>> @on_local_main_process(ctx)
        ... def hello() -> str:
        ...     return "hi from node 1"
        >>> hello()
        'hi from node 1'
    """
    return _only_where(ctx.is_local_main)


def on_last_process(ctx: RunContext) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Decorate a function so it runs on the last rank (`world_size - 1`) only; elsewhere None.

    Nothing is synchronised: other ranks go on at once. On one process the last rank is rank 0.

    Args:
        ctx: the run context; the function runs where `ctx.is_last`.

    Returns:
        A decorator; the function it returns calls the decorated one on the last rank and
        returns its result there, and returns None on other ranks without calling it.

    Example:
        >>> from accel import RunContext, on_last_process
        >>> @on_last_process(RunContext(rank=0, world_size=2))
        ... def hello() -> str:
        ...     return "hi"
        >>> print(hello())
        None
    """
    return _only_where(ctx.is_last)


def on_process(ctx: RunContext, rank: int) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Decorate a function so it runs on global rank `rank` only; elsewhere it returns None.

    Nothing is synchronised: other ranks go on at once. Accelerate's
    `on_process(process_index=k)`; for a local rank test `ctx.local_rank` yourself.

    Args:
        ctx: the run context; the function runs where `ctx.rank == rank`.
        rank: the global rank to run on, in `[0, ctx.world_size)`.

    Returns:
        A decorator; the function it returns calls the decorated one on rank `rank` and returns
        its result there, and returns None on other ranks without calling it.

    Raises:
        ValueError: when `rank` is not in `[0, ctx.world_size)` (the function would run
            nowhere).

    Example:
        >>> from accel import RunContext, on_process
        >>> @on_process(RunContext(rank=1, world_size=2), 1)
        ... def hello() -> str:
        ...     return "hi from rank 1"
        >>> hello()
        'hi from rank 1'
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ctx.world_size:
        raise ValueError(
            f"on_process: rank={rank!r} is not a rank of this run; expected an int in "
            f"[0, {ctx.world_size}). Pass a rank below ctx.world_size={ctx.world_size}."
        )
    return _only_where(ctx.rank == rank)


def _only_where(flag: bool) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    def decorate(fn: Callable[P, R]) -> Callable[P, R | None]:
        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
            return fn(*args, **kwargs) if flag else None

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
        >>> from accel import RunContext, run_on_main
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
        >>> from accel import RunContext, any_rank
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
        >>> from accel import RunContext, split_between_processes
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
