"""Collectives over nested tuples, lists and dicts of tensors.

Every function takes the context first and runs on `ctx.process_group`, so two contexts in one
process (say, the whole world and a sub-group) never mix. On one process each returns its input.

Before moving data, the ranks agree on what they hold. Each rank all-gathers one buffer of a
size every rank knows without asking (`round_bytes(world_size)`): an 8-byte hash of its
structure, shapes and dtypes, then, when they fit, the bytes of its tensors. If the hashes
differ, the ranks swap full descriptions and every rank raises the same error naming the ranks
and shapes, instead of hanging in a collective with mismatched sizes or returning garbage. If
they agree and the data came along (small inputs: a loss, a batch of predictions), that one
collective was the whole call; otherwise a second round moves the data, now known to match.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType
from typing import Any, TypeVar, get_args

import torch
import torch.distributed as dist

from accel._agreement import all_gather_single, describe_leaves, exchange, stacked
from accel._groups import comm_device, global_rank, named_collective, require_group
from accel._tree import TreeDef, tensor_leaves, unflatten
from accel._typing import ReduceOp, TensorTree
from accel.context import RunContext

__all__ = [
    "broadcast",
    "broadcast_object",
    "gather",
    "gather_object",
    "pad_across_processes",
    "reduce",
]

T = TypeVar("T")

_REDUCE_OPS = MappingProxyType(
    {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
)


def gather(ctx: RunContext, tree: TensorTree) -> TensorTree:
    """Concatenate every rank's tensors along dim 0, in rank order, on every rank.

    0-dim tensors are gathered into a 1-dim tensor of `world_size` values. On one process
    the input is returned as it is. Call it on every rank.

    Args:
        ctx: the run context; gathers over `ctx.process_group`.
        tree: a tensor, or nested tuples, lists and dicts of tensors; every rank passes the
            same structure, dtypes and shapes (dim 0 too: pad with `pad_across_processes`).

    Returns:
        The same structure, each tensor replaced by the concatenation of every rank's along
        dim 0 (rank 0's first), on the device the tensor was on (a host tensor travels through
        the run's device on NCCL, which takes nothing else, and comes back to the host).

    Raises:
        TypeError: for a leaf that is not a tensor (with `world_size > 1`).
        ValueError: when ranks pass different shapes or dtypes (on every rank).
        RuntimeError: when `world_size > 1` and no process group is initialised, or the
            collective fails or times out (another rank did not make the same call).

    Example:
        >>> from accel import gather, RunContext
        >>> import torch
        >>> gather(RunContext(), {"x": torch.tensor([1.0, 2.0])})
        {'x': tensor([1., 2.])}
    """
    leaves, treedef = tensor_leaves("gather", tree)  # checked at any world size
    if ctx.world_size == 1:
        return tree
    hint = "To gather tensors whose dim 0 differs, call pad_across_processes(ctx, tree) first."
    return unflatten(treedef, gather_leaves(ctx, "gather", leaves, treedef, hint))


def gather_leaves(
    ctx: RunContext, fn: str, leaves: Sequence[torch.Tensor], treedef: TreeDef, hint: str
) -> list[torch.Tensor]:
    """`gather` of a flattened tree (world_size > 1); errors name `fn` and end with `hint`."""
    group = require_group(ctx, fn)
    rows, offsets = exchange(ctx, fn, describe_leaves(leaves, treedef, None), leaves, hint, group)
    if rows is not None:
        return [
            stacked(rows, offset, t, (-1, *t.shape[1:]))
            for t, offset in zip(leaves, offsets, strict=True)
        ]
    out = []
    with named_collective(ctx, fn):
        for t in leaves:
            sent = _sendable(ctx, t.reshape(1) if t.dim() == 0 else t.contiguous())
            result = sent.new_empty((ctx.world_size * sent.shape[0], *sent.shape[1:]))
            all_gather_single(result, sent, group=group)
            out.append(result.to(t.device))
    return out


def _sendable(ctx: RunContext, t: torch.Tensor) -> torch.Tensor:
    """`t` where the backend takes it: NCCL takes tensors on the GPU only, so a tensor on the
    host travels through the run's device (and its result comes back to the host)."""
    return t.to(comm_device(ctx))


def reduce(ctx: RunContext, tree: TensorTree, *, op: ReduceOp = "mean") -> TensorTree:
    """Reduce every tensor element-wise over the ranks with `op`; every rank gets the result.

    The inputs are not modified. "mean" needs floating-point tensors. Call it on every rank.

    Args:
        ctx: the run context; reduces over `ctx.process_group`.
        tree: a tensor, or nested tuples, lists and dicts of tensors, with the same structure,
            dtypes and shapes on every rank.
        op: "sum", "mean", "max" or "min"; default "mean".

    Returns:
        The same structure holding the reduced tensors (new tensors, each on its input's
        device, as `gather`'s are; on one process, `tree` itself).

    Raises:
        ValueError: for an unknown `op`, or ranks that pass different shapes or dtypes.
        TypeError: for a leaf that is not a tensor, or `op="mean"` on integer tensors.
        RuntimeError: when `world_size > 1` and no process group is initialised, or the
            collective fails or times out (another rank did not make the same call).

    Example:
        >>> from accel import reduce, RunContext
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
    rows, offsets = exchange(
        ctx,
        "reduce",
        describe_leaves(leaves, treedef, None),
        leaves,
        "",
        group,
        call=f"reduce(op={op!r})",
    )
    if rows is not None:  # reduce the gathered copies locally, in rank order on every rank
        stacks = [stacked(rows, offset, t) for t, offset in zip(leaves, offsets, strict=True)]
        return unflatten(treedef, [_reduce_local(x, op).to(x.dtype) for x in stacks])
    out = []
    with named_collective(ctx, "reduce"):
        for t in leaves:
            result = t.to(comm_device(ctx), copy=True)  # NCCL's device; never the caller's
            dist.all_reduce(result, op=_REDUCE_OPS.get(op, dist.ReduceOp.SUM), group=group)
            if op == "mean":
                result /= ctx.world_size
            out.append(result.to(t.device))
    return unflatten(treedef, out)


def broadcast(ctx: RunContext, tree: TensorTree, *, src: int = 0) -> TensorTree:
    """Return rank `src`'s tensors on every rank (each rank passes same-shaped tensors).

    Call it on every rank; the tensors other ranks pass only give the shapes and dtypes.

    Args:
        ctx: the run context; broadcasts over `ctx.process_group`.
        tree: a tensor, or nested tuples, lists and dicts of tensors, with the same structure,
            dtypes and shapes on every rank.
        src: the rank (of `ctx.process_group`) whose tensors are sent; default 0.

    Returns:
        The same structure holding rank `src`'s values, each on this rank's tensor's device
        (on one process, `tree` itself).

    Raises:
        ValueError: for a `src` outside `[0, world_size)`, or ranks that pass different
            shapes or dtypes.
        TypeError: for a leaf that is not a tensor (with `world_size > 1`).
        RuntimeError: when `world_size > 1` and no process group is initialised, or the
            collective fails or times out (another rank did not make the same call).

    Example:
        >>> from accel import broadcast, RunContext
        >>> import torch
        >>> broadcast(RunContext(), torch.ones(2))
        tensor([1., 1.])
    """
    _check_src("broadcast", ctx, src)
    leaves, treedef = tensor_leaves("broadcast", tree)
    if ctx.world_size == 1:
        return tree
    group = require_group(ctx, "broadcast")
    description = describe_leaves(leaves, treedef, None)
    call = f"broadcast(src={src})"
    rows, offsets = exchange(ctx, "broadcast", description, leaves, "", group, call=call)
    if rows is not None:
        out = [
            stacked(rows[src : src + 1], offset, t)[0]
            for t, offset in zip(leaves, offsets, strict=True)
        ]
        return unflatten(treedef, out)
    out = []
    with named_collective(ctx, "broadcast"):
        for t in leaves:
            if ctx.rank == src:
                result = _sendable(ctx, t.contiguous())
            else:
                result = torch.empty_like(t, device=comm_device(ctx))
            dist.broadcast(result, src=global_rank(ctx, src), group=group)
            out.append(result.to(t.device))
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

    Only the size along `dim` may differ between ranks. Call it on every rank.

    Args:
        ctx: the run context; sizes are compared over `ctx.process_group`.
        tree: a tensor, or nested tuples, lists and dicts of tensors.
        dim: the tensor dimension to pad; default 0 (negative counts from the end).
        pad_index: the value the padding is filled with; default 0.
        pad_first: put the padding before the data instead of after it; default False.

    Returns:
        The same structure with each tensor padded (a new tensor) or, when it already has the
        largest size, unchanged; on one process, `tree` itself.

    Raises:
        ValueError: with `world_size > 1`, for a `dim` out of range, or ranks whose shapes
            differ elsewhere than along `dim`.
        TypeError: for a leaf that is not a tensor (with `world_size > 1`).
        RuntimeError: when `world_size > 1` and no process group is initialised, or the
            collective fails or times out (another rank did not make the same call).

    Example:
        >>> from accel import pad_across_processes, RunContext
        >>> import torch
        >>> pad_across_processes(RunContext(), torch.tensor([1, 2]))
        tensor([1, 2])
    """
    leaves, treedef = tensor_leaves("pad_across_processes", tree)
    for t in leaves:
        if not -t.dim() <= dim < t.dim():
            raise ValueError(
                f"pad_across_processes: dim={dim} is out of range for a tensor of shape "
                f"{list(t.shape)}; pass a dim in [{-t.dim()}, {t.dim()})."
            )
    if ctx.world_size == 1:
        return tree
    group = require_group(ctx, "pad_across_processes")
    sizes = torch.tensor([t.shape[dim] for t in leaves], dtype=torch.int64)
    axis = dim % leaves[0].dim() if leaves else dim  # -1 and 1 name one dim of a 2-D tensor
    rows, offsets = exchange(
        ctx, "pad_across_processes", describe_leaves(leaves, treedef, dim), [sizes],
        "Only the size along `dim` may differ.", group, call=f"pad_across_processes(dim={axis})",
    )  # fmt: skip
    if rows is not None:
        everyone = stacked(rows, offsets[0], sizes)
    else:  # too many leaves to ride along with the hash
        everyone = sizes.to(comm_device(ctx)).new_empty((ctx.world_size * len(leaves),))
        with named_collective(ctx, "pad_across_processes"):
            all_gather_single(everyone, sizes.to(everyone.device), group=group)
        everyone = everyone.view(ctx.world_size, len(leaves))
    largest = everyone.amax(dim=0).tolist()
    return unflatten(
        treedef,
        [pad_tensor(t, dim, n, pad_index, pad_first) for t, n in zip(leaves, largest, strict=True)],
    )


def _reduce_local(stack: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    if op == "max":
        return stack.amax(dim=0)
    if op == "min":
        return stack.amin(dim=0)
    total = stack.sum(dim=0)
    return total / stack.shape[0] if op == "mean" else total


def pad_tensor(
    t: torch.Tensor, dim: int, size: int, value: int | float, first: bool
) -> torch.Tensor:
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

    Call it on every rank.

    Args:
        ctx: the run context; gathers over `ctx.process_group`.
        obj: any picklable object.

    Returns:
        A list of `world_size` objects, rank 0's first; `[obj]` on one process.

    Raises:
        RuntimeError: when `world_size > 1` and no process group is initialised, or the
            collective fails or times out (another rank did not make the same call).

    Example:
        >>> from accel import gather_object, RunContext
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


def gather_parts(ctx: RunContext, part: Any, device: torch.device | None) -> Any:
    """Every rank's `part` concatenated in rank order, through one object exchange.

    A part is a list of Python objects, or `(treedef, leaves)` of tensors concatenated along
    dim 0 (moved through the CPU, returned on `device`), or None for a rank with nothing to
    give. For the rounds of gather_for_metrics that some ranks have no batch in.
    """
    if isinstance(part, tuple):
        part = (part[0], [leaf.cpu() for leaf in part[1]])
    parts = [p for p in gather_object(ctx, part) if p is not None]
    if not parts:
        return []
    if isinstance(parts[0], list):
        return [item for p in parts for item in p]
    to = device if device is not None else torch.device("cpu")
    leaves = [torch.cat([p[1][i] for p in parts]).to(to) for i in range(len(parts[0][1]))]
    return unflatten(parts[0][0], leaves)


def broadcast_object(ctx: RunContext, obj: T, *, src: int = 0) -> T:
    """Return rank `src`'s `obj` on every rank (pickled; other ranks may pass None).

    Call it on every rank.

    Args:
        ctx: the run context; broadcasts over `ctx.process_group`.
        obj: on rank `src`, any picklable object; ignored elsewhere.
        src: the rank (of `ctx.process_group`) whose object is sent; default 0.

    Returns:
        Rank `src`'s object (`obj` itself on one process).

    Raises:
        ValueError: for a `src` outside `[0, world_size)`.
        RuntimeError: when `world_size > 1` and no process group is initialised, or the
            collective fails or times out (another rank did not make the same call).

    Example:
        >>> from accel import broadcast_object, RunContext
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
