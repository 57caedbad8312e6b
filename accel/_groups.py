"""Process-group plumbing shared by the collectives and the process helpers.

Below both `accel.collectives` and `accel.distributed`: which torch group a context means, where
small bookkeeping tensors live, how a group rank maps to a global rank, how a failing torch
call is re-raised naming the accel call that made it, and how a step every rank takes fails on
every rank when it fails on one (`every_rank_step`).
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from accel._exit import register_exit_guard
from accel.context import RunContext
from accel.errors import NOT_INITIALIZED_MSG

T = TypeVar("T")
Failure = tuple[int, str]
"""A rank's error as it travels to the other ranks: its errno (0 for an error that is not the
system's) and a text naming its file."""


def require_group(ctx: RunContext, fn: str) -> Any:
    """Return the group to pass to torch.distributed for a multi-process context.

    `ctx.process_group=None` means torch's default group, as `group=None` does in torch; it
    must exist and match the context's world size. Raises naming `fn` otherwise.
    """
    register_exit_guard()  # the group may be the caller's own, made without init_distributed
    if ctx.process_group is not None:
        return ctx.process_group
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(NOT_INITIALIZED_MSG.format(fn=fn, world_size=ctx.world_size))
    if dist.get_world_size() != ctx.world_size:
        raise RuntimeError(
            f"{fn}: the context has world_size={ctx.world_size} but torch's default process "
            f"group has {dist.get_world_size()} ranks; pass process_group= for a sub-group."
        )
    return None


def comm_device(ctx: RunContext) -> torch.device:
    """The device a collective's own small tensors live on: the run's device on NCCL (which
    takes tensors on the GPU only) and on a CPU run (the device canary's included); the host
    for gloo on a GPU."""
    if ctx.backend == "nccl" or ctx.device.type == "cpu":
        return ctx.device
    return torch.device("cpu")


def global_rank(ctx: RunContext, group_rank: int) -> int:
    """Map a rank of `ctx.process_group` to the global rank torch's src arguments take."""
    if ctx.process_group is None:
        return group_rank
    return dist.get_global_rank(ctx.process_group, group_rank)


@contextmanager
def named_collective(ctx: RunContext, fn: str) -> Iterator[None]:
    """Re-raise a failing torch.distributed call with the accel call and rank that made it."""
    try:
        yield
    except RuntimeError as err:  # DistBackendError and gloo/nccl timeouts subclass RuntimeError
        text = str(err)
        if text.startswith("device canary:"):  # a tensor NCCL would refuse, not a peer's fault
            raise RuntimeError(f"{fn}: {text}") from err
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        what = f"timed out after {ctx.timeout}" if timed_out else "failed"
        raise RuntimeError(
            f"{fn}: collective {what} on rank {ctx.rank} of world_size={ctx.world_size}; "
            "another rank is probably not calling the same collective (or has died). "
            f"torch.distributed said: {text.splitlines()[0] if text else type(err).__name__}"
        ) from err


def barrier(ctx: RunContext, fn: str) -> None:
    """Block until every rank of the context reaches this point; a failure names `fn`."""
    if ctx.world_size == 1:
        return
    group = require_group(ctx, fn)
    with named_collective(ctx, fn):
        if ctx.backend == "nccl":
            dist.barrier(group=group, device_ids=[ctx.device.index or 0])
        else:
            dist.barrier(group=group)


def describe(err: BaseException) -> Failure:
    """A rank's error as it travels to the other ranks (in a gather, or a save's marker file)."""
    if isinstance(err, OSError):
        where = f" ({err.filename})" if err.filename else ""
        return err.errno or errno.EIO, f"{err.strerror or err}{where}"
    return 0, f"{type(err).__name__}: {err}"


def reported(message: str, code: int) -> Exception:
    """The error to raise for another rank's `describe`d one, with `message`: an OSError of
    its errno (which picks the subclass: FileExistsError, PermissionError...), else a
    RuntimeError."""
    return OSError(code, message) if code else RuntimeError(message)


def every_rank_step(
    ctx: RunContext, fn: str, step: Callable[[], T], *, failed: Exception | None = None
) -> list[T]:
    """Run `step` on this rank and gather every rank's (value, failure) in one collective.

    When a rank failed, every rank raises the same error, `rank <r>: <its error>` (on the
    failing rank chained from its own), so no rank goes on to a collective a failed rank will
    not join, nor returns from a step that did not happen everywhere. Otherwise returns every
    rank's value, in rank order. `failed` is an error this rank already met since the last
    collective (a file rank 0 could not create before a barrier): it is shared as if `step`
    raised it, and `step` is not run. The failing rank named is the first other than rank 0
    when there is one: rank 0 coordinates, and may have failed only because it was told
    (through a save's marker files) that another rank had. With one process there is no
    collective and a failure is raised as it is.
    """
    if ctx.world_size == 1:
        if failed is not None:
            raise failed
        return [step()]
    mine: tuple[T | None, Failure | None] = (None, None)
    error = failed
    if error is None:
        try:
            mine = (step(), None)
        except Exception as err:  # shared below, then raised on every rank
            error = err
    if error is not None:
        mine = (None, describe(error))
    everyone: list[Any] = [None] * ctx.world_size
    with named_collective(ctx, fn):
        dist.all_gather_object(everyone, mine, group=require_group(ctx, fn))
    failing = [r for r, (_, failure) in enumerate(everyone) if failure is not None]
    if failing:
        rank = ([r for r in failing if r != 0] or failing)[0]
        code, text = everyone[rank][1]
        raise reported(f"rank {rank}: {text}", code) from error
    return [v for v, _ in everyone]
