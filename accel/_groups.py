"""Process-group plumbing shared by the collectives and the process helpers.

Below both `accel.collectives` and `accel.distributed`: which torch group a context means, where
small bookkeeping tensors live, how a group rank maps to a global rank, and how a failing torch
call is re-raised naming the accel call that made it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from accel._exit import register_exit_guard
from accel.context import RunContext
from accel.errors import NOT_INITIALIZED_MSG


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
    """The device small bookkeeping tensors must live on for this backend."""
    return ctx.device if ctx.backend == "nccl" else torch.device("cpu")


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
