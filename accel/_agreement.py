"""The agreement check under every collective: ranks compare what they hold before moving it.

Each rank all-gathers one buffer of a size every rank knows without asking
(`round_bytes(world_size)`): an 8-byte hash of its call, structure, shapes and dtypes, then, when
they fit, the bytes of its tensors. If the hashes differ, the ranks swap full descriptions and
every rank raises the same error naming the ranks and shapes, instead of hanging in a collective
with mismatched sizes or returning garbage. If they agree and the data came along (small inputs:
a loss, a batch of predictions), that one collective was the whole call; otherwise a second
round moves the data, now known to match.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from accel._groups import comm_device, named_collective
from accel._tree import TreeDef
from accel.context import RunContext

# torch 2.13 renamed all_gather_into_tensor to all_gather_single; support both ends of >=2.11.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def describe_leaves(leaves: Sequence[torch.Tensor], treedef: TreeDef, dim: int | None) -> str:
    parts = []
    for t in leaves:
        shape = list(t.shape)
        if dim is not None and t.dim() > 0:
            shape[dim] = -1  # the padded dim may differ; mark it free
        parts.append(f"{str(t.dtype).removeprefix('torch.')}{shape}")
    return f"{describe_structure(treedef)} {' '.join(parts)}"


def describe_structure(td: TreeDef) -> str:
    if td.kind == "leaf":
        return "*"
    inner = ",".join(describe_structure(c) for c in td.children)
    return f"{td.kind}{list(td.keys) if td.keys else ''}({inner})"


HEADER_BYTES = 16  # the int64 hash, then 8 bytes that keep the payload 16-byte aligned
ROUND_TOTAL_BYTES = 32 * 1024
# What each rank receives in the first round, all ranks together. On gloo over loopback an
# all-gather of 16 KiB per rank takes as long as one of 16 bytes (benchmarks/collectives.py),
# so small inputs ride along with the hash for free; the budget shrinks per rank as the world
# grows, so a scalar gathered over 1024 ranks still moves only 32 KiB.


def round_bytes(world_size: int) -> int:
    return max(HEADER_BYTES + 240, ROUND_TOTAL_BYTES // world_size) // 16 * 16


def byte_layout(leaves: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    offsets, end = [], HEADER_BYTES
    for t in leaves:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // 16) * 16
    return offsets, end


def exchange(
    ctx: RunContext,
    fn: str,
    description: str,
    leaves: Sequence[torch.Tensor],
    hint: str,
    group: Any,
    *,
    call: str | None = None,
) -> tuple[torch.Tensor | None, list[int]]:
    """All-gather the hash of `call` and `description` and, if they fit, the bytes of `leaves`.

    `call` names the collective and the arguments every rank must agree on (`reduce(op='sum')`,
    `broadcast(src=0)`); it defaults to `fn`. Ranks that disagree on it all raise too, instead of
    running different collectives (a hang) or reducing with different ops (garbage).

    Returns every rank's row (uint8 [world_size, round_bytes]) and the byte offset of each
    leaf in it, or None instead of the rows when the leaves did not fit (the caller moves
    them itself, knowing that every rank holds the same shapes). Raises on every rank when the
    descriptions differ.
    """
    call = fn if call is None else call
    digest = hashlib.blake2b(f"{call}|{description}".encode(), digest_size=8).digest()
    size = round_bytes(ctx.world_size)
    offsets, end = byte_layout(leaves)
    inline = end <= size
    device = comm_device(ctx)
    row = torch.empty(size, dtype=torch.uint8, device=device)
    row[:8].view(torch.int64).fill_(int.from_bytes(digest, "little", signed=True))
    if inline:
        for t, offset in zip(leaves, offsets, strict=True):
            nbytes = t.numel() * t.element_size()
            row[offset : offset + nbytes].copy_(t.detach().reshape(-1).view(torch.uint8))
    flat = torch.empty(ctx.world_size * size, dtype=torch.uint8, device=device)
    with named_collective(ctx, fn):
        all_gather_single(flat, row, group=group)
    rows = flat.view(ctx.world_size, size)
    hashes = rows[:, :8].view(torch.int64).flatten().tolist()
    if hashes.count(hashes[0]) != len(hashes):
        descriptions: list[Any] = [None] * ctx.world_size
        with named_collective(ctx, fn):
            dist.all_gather_object(descriptions, (call, description), group=group)
        if len({c for c, _ in descriptions}) > 1:
            listing = "; ".join(f"rank {r}: {c}" for r, (c, _) in enumerate(descriptions))
            raise ValueError(
                f"{fn}: the ranks made different calls ({listing}); every rank must call the "
                "same collective with the same op and src at the same point."
            )
        listing = "; ".join(f"rank {r}: {d}" for r, (_, d) in enumerate(descriptions))
        raise ValueError(
            f"{fn}: the ranks passed different inputs ({listing}); every rank must pass the "
            f"same structure, dtypes and shapes. {hint}"
        )
    return (rows if inline else None), offsets


def stacked(
    rows: torch.Tensor, offset: int, t: torch.Tensor, shape: Sequence[int] | None = None
) -> torch.Tensor:
    """Every rank's copy of leaf `t` from the exchanged rows, as [world_size, *t.shape].

    (Or in `shape`, for gather's concatenation.) A new tensor, on `t`'s device.
    """
    nbytes = t.numel() * t.element_size()
    part = rows[:, offset : offset + nbytes].contiguous().view(t.dtype)
    part = part.view(*shape) if shape is not None else part.view(rows.shape[0], *t.shape)
    return part if part.device == t.device else part.to(t.device)
