"""Collectives over nested tuples, lists and dicts of tensors.

Every function takes the context first and runs on `ctx.process_group`, so two contexts in one
process (say, the whole world and a sub-group) never mix. On one process each returns its input.

Before moving data, the ranks agree on what they hold: each sends an 8-byte hash of its
structure, shapes and dtypes in one small all-gather. If the hashes differ, the ranks swap full
descriptions and every rank raises the same error naming the ranks and shapes, instead of
hanging in a collective with mismatched sizes or returning garbage.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any, TypeVar, get_args

import torch
import torch.distributed as dist

from accel._tree import TreeDef, tensor_leaves, unflatten
from accel._typing import ReduceOp, TensorTree
from accel.context import RunContext
from accel.errors import NOT_INITIALIZED_MSG

__all__ = [
    "broadcast",
    "broadcast_object",
    "gather",
    "gather_object",
    "pad_across_processes",
    "reduce",
]

T = TypeVar("T")

# torch 2.13 renamed all_gather_into_tensor to all_gather_single; support both ends of >=2.4.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_REDUCE_OPS = MappingProxyType(
    {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
)


def require_group(ctx: RunContext, fn: str) -> Any:
    """Return the group to pass to torch.distributed for a multi-process context.

    `ctx.process_group=None` means torch's default group, as `group=None` does in torch; it
    must exist and match the context's world size. Raises naming `fn` otherwise.
    """
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


def _describe(leaves: Sequence[torch.Tensor], treedef: TreeDef, dim: int | None) -> str:
    parts = []
    for t in leaves:
        shape = list(t.shape)
        if dim is not None and t.dim() > 0:
            shape[dim] = -1  # the padded dim may differ; mark it free
        parts.append(f"{str(t.dtype).removeprefix('torch.')}{shape}")
    return f"{_structure(treedef)} {' '.join(parts)}"


def _structure(td: TreeDef) -> str:
    if td.kind == "leaf":
        return "*"
    inner = ",".join(_structure(c) for c in td.children)
    return f"{td.kind}{list(td.keys) if td.keys else ''}({inner})"


def _check_agreement(ctx: RunContext, fn: str, description: str, hint: str, group: Any) -> None:
    digest = hashlib.blake2b(description.encode(), digest_size=8).digest()
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], device=comm_device(ctx))
    everyone = torch.empty(ctx.world_size, dtype=torch.int64, device=mine.device)
    with named_collective(ctx, fn):
        _all_gather_single(everyone, mine, group=group)
    if bool((everyone == everyone[0]).all()):
        return
    descriptions: list[Any] = [None] * ctx.world_size
    with named_collective(ctx, fn):
        dist.all_gather_object(descriptions, description, group=group)
    listing = "; ".join(f"rank {r}: {d}" for r, d in enumerate(descriptions))
    raise ValueError(
        f"{fn}: the ranks passed different inputs ({listing}); every rank must pass the same "
        f"structure, dtypes and shapes. {hint}"
    )


def gather(ctx: RunContext, tree: TensorTree) -> TensorTree:
    """Concatenate every rank's tensors along dim 0, in rank order, on every rank.

    0-dim tensors are gathered into a 1-dim tensor of `world_size` values. On one process
    the input is returned as it is.

    Example:
        >>> import torch
        >>> gather(RunContext(), {"x": torch.tensor([1.0, 2.0])})
        {'x': tensor([1., 2.])}

    Raises:
        ValueError: when ranks pass different shapes or dtypes (on every rank).
    """
    if ctx.world_size == 1:
        return tree
    group = require_group(ctx, "gather")
    leaves, treedef = tensor_leaves("gather", tree)
    _check_agreement(
        ctx, "gather", _describe(leaves, treedef, None),
        "To gather tensors whose dim 0 differs, call pad_across_processes(ctx, tree) first.",
        group,
    )  # fmt: skip
    out = []
    with named_collective(ctx, "gather"):
        for t in leaves:
            t = t.reshape(1) if t.dim() == 0 else t.contiguous()
            result = t.new_empty((ctx.world_size * t.shape[0], *t.shape[1:]))
            _all_gather_single(result, t, group=group)
            out.append(result)
    return unflatten(treedef, out)


def reduce(ctx: RunContext, tree: TensorTree, *, op: ReduceOp = "mean") -> TensorTree:
    """Reduce every tensor element-wise over the ranks with `op`; every rank gets the result.

    The inputs are not modified. "mean" needs floating-point tensors.

    Example:
        >>> import torch
        >>> reduce(RunContext(), torch.tensor([1.0, 3.0]), op="max")
        tensor([1., 3.])
    """
    if op not in get_args(ReduceOp):
        raise ValueError(
            f"reduce: op={op!r} is not supported; expected one of {get_args(ReduceOp)}."
        )
    leaves, treedef = tensor_leaves("reduce", tree)
    if op == "mean":
        for t in leaves:
            if not (t.is_floating_point() or t.is_complex()):
                raise TypeError(
                    f"reduce: op='mean' needs floating-point tensors, got {t.dtype}; cast "
                    "first (t.float()) or use op='sum'."
                )
    if ctx.world_size == 1:
        return tree
    group = require_group(ctx, "reduce")
    _check_agreement(ctx, "reduce", _describe(leaves, treedef, None), "", group)
    out = []
    with named_collective(ctx, "reduce"):
        for t in leaves:
            result = t.clone()
            dist.all_reduce(result, op=_REDUCE_OPS.get(op, dist.ReduceOp.SUM), group=group)
            if op == "mean":
                result /= ctx.world_size
            out.append(result)
    return unflatten(treedef, out)


def broadcast(ctx: RunContext, tree: TensorTree, *, src: int = 0) -> TensorTree:
    """Return rank `src`'s tensors on every rank (each rank passes same-shaped tensors).

    Example:
        >>> import torch
        >>> broadcast(RunContext(), torch.ones(2))
        tensor([1., 1.])
    """
    _check_src("broadcast", ctx, src)
    if ctx.world_size == 1:
        return tree
    group = require_group(ctx, "broadcast")
    leaves, treedef = tensor_leaves("broadcast", tree)
    _check_agreement(ctx, "broadcast", _describe(leaves, treedef, None), "", group)
    out = []
    with named_collective(ctx, "broadcast"):
        for t in leaves:
            result = t.contiguous() if ctx.rank == src else torch.empty_like(t)
            dist.broadcast(result, src=global_rank(ctx, src), group=group)
            out.append(result)
    return unflatten(treedef, out)


def pad_across_processes(
    ctx: RunContext,
    tree: TensorTree,
    *,
    dim: int = 0,
    pad_index: int | float = 0,
    pad_first: bool = False,
) -> TensorTree:
    """Pad each tensor along `dim` to the largest size any rank holds, so they can be gathered.

    Example:
        >>> import torch
        >>> pad_across_processes(RunContext(), torch.tensor([1, 2]))
        tensor([1, 2])
    """
    if ctx.world_size == 1:
        return tree
    group = require_group(ctx, "pad_across_processes")
    leaves, treedef = tensor_leaves("pad_across_processes", tree)
    for t in leaves:
        if not -t.dim() <= dim < t.dim():
            raise ValueError(
                f"pad_across_processes: dim={dim} is out of range for a tensor of shape "
                f"{list(t.shape)}; pass a dim in [{-t.dim()}, {t.dim()})."
            )
    _check_agreement(
        ctx, "pad_across_processes", _describe(leaves, treedef, dim),
        "Only the size along `dim` may differ.", group,
    )  # fmt: skip
    sizes = torch.tensor([t.shape[dim] for t in leaves], device=comm_device(ctx))
    everyone = sizes.new_empty((ctx.world_size * len(leaves),))
    with named_collective(ctx, "pad_across_processes"):
        _all_gather_single(everyone, sizes, group=group)
    largest = everyone.view(ctx.world_size, len(leaves)).amax(dim=0).tolist()
    return unflatten(
        treedef,
        [_pad(t, dim, n, pad_index, pad_first) for t, n in zip(leaves, largest, strict=True)],
    )


def _pad(t: torch.Tensor, dim: int, size: int, value: int | float, first: bool) -> torch.Tensor:
    if t.shape[dim] == size:
        return t
    shape = list(t.shape)
    shape[dim] = size
    out = t.new_full(shape, value)
    start = size - t.shape[dim] if first else 0
    out.narrow(dim, start, t.shape[dim]).copy_(t)
    return out


def gather_object(ctx: RunContext, obj: T) -> list[T]:
    """Return a list of every rank's `obj`, in rank order (pickled; use `gather` for tensors).

    Example:
        >>> gather_object(RunContext(), {"loss": 0.5})
        [{'loss': 0.5}]
    """
    if ctx.world_size == 1:
        return [obj]
    group = require_group(ctx, "gather_object")
    out: list[Any] = [None] * ctx.world_size
    with named_collective(ctx, "gather_object"):
        dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(ctx: RunContext, obj: T, *, src: int = 0) -> T:
    """Return rank `src`'s `obj` on every rank (pickled; other ranks may pass None).

    Example:
        >>> broadcast_object(RunContext(), [1, 2])
        [1, 2]
    """
    _check_src("broadcast_object", ctx, src)
    if ctx.world_size == 1:
        return obj
    group = require_group(ctx, "broadcast_object")
    box: list[Any] = [obj]
    with named_collective(ctx, "broadcast_object"):
        dist.broadcast_object_list(box, src=global_rank(ctx, src), group=group)
    return box[0]  # type: ignore[no-any-return]


def _check_src(fn: str, ctx: RunContext, src: int) -> None:
    if not 0 <= src < ctx.world_size:
        raise ValueError(
            f"{fn}: src={src!r} is not a rank of this context; expected 0 <= src < "
            f"world_size={ctx.world_size}."
        )
