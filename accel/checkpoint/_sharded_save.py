"""Saving a sharded model's safetensors files without gathering it: rank 0 pre-sizes each file
from global shapes, every rank writes its own slices into place (`pwritev`), and the files are
published as an unsharded save publishes them. Where the ranks do not share the folder's
filesystem, the tensors are streamed to rank 0 one at a time instead.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from accel._groups import barrier, require_group
from accel.checkpoint._model_io import FILE_METADATA, partial_path
from accel.checkpoint._safetensors_io import header_bytes
from accel.checkpoint._sharded_io import (
    as_buffer,
    byte_runs,
    local_indices,
    merge_runs,
    owns_copy,
    split_checksums,
)
from accel.context import RunContext
from accel.parallel._dtensor import is_dtensor


def presize(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    """Create `path` holding the header of `tensors` (global shapes) and room for their bytes."""
    head = header_bytes(tensors, metadata)
    total = len(head) + sum(t.numel() * t.element_size() for t in tensors.values())
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(total)


def write_slices(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str], *, is_main: bool
) -> None:
    """Write this rank's slices of `tensors` into the pre-sized `path`, and fsync them.

    A DTensor slice is written by one of its replicas; a plain tensor (the same on every rank)
    by the main rank.
    """
    start = len(header_bytes(tensors, metadata))
    fd = os.open(path, os.O_WRONLY)
    try:
        offset = start
        for t in tensors.values():
            nbytes = t.numel() * t.element_size()
            for file_at, view in _slices_to_write(t, is_main):
                os.pwritev(fd, [view], offset + file_at)
            offset += nbytes
        os.fsync(fd)
    finally:
        os.close(fd)


def _slices_to_write(t: torch.Tensor, is_main: bool) -> Iterator[tuple[int, memoryview]]:
    if is_dtensor(t):
        if not owns_copy(t):
            return
        local, indices = t.to_local().detach().cpu().contiguous(), local_indices(t)
    else:
        if not is_main:
            return
        local = t.detach().cpu().contiguous()
        indices = [torch.arange(n) for n in t.shape]
    if local.numel() == 0:
        return
    view = as_buffer(local)
    for file_at, local_at, length in merge_runs(
        byte_runs(list(t.shape), indices, t.element_size())
    ):
        yield file_at, view[local_at : local_at + length]


def save_sharded(
    ctx: RunContext,
    directory: Path,
    layout: Sequence[tuple[str, Mapping[str, torch.Tensor]]],
    publish: Callable[[Callable[..., tuple[int, int]]], None],
) -> None:
    """Write a sharded model's files without gathering it, then publish them on rank 0.

    Rank 0 creates each file under its partial name with the header (from global shapes) and
    its full size. When every rank sees those files (a shared filesystem), every rank writes
    its slices in place and fsyncs, and the checksums are split across ranks; otherwise the
    tensors are streamed to rank 0 one at a time, which writes them. Then rank 0 calls
    `publish(write)`, whose `write` returns the (size, crc32) of a file already written:
    renames into place, index and manifest.
    """
    fn = "save_model"
    group = require_group(ctx, fn) if ctx.world_size > 1 else None
    paths = [partial_path(directory / name) for name, _ in layout]
    if ctx.is_main:
        directory.mkdir(parents=True, exist_ok=True)
        for path, (_, tensors) in zip(paths, layout, strict=True):
            presize(path, tensors, FILE_METADATA)
    barrier(ctx, fn)
    if _is_shared(ctx, paths, group):
        for path, (_, tensors) in zip(paths, layout, strict=True):
            write_slices(path, tensors, FILE_METADATA, is_main=ctx.is_main)
        barrier(ctx, fn)
        sums = dict(zip(paths, split_checksums(paths, group), strict=True))
    else:
        sums = _stream_to_main(ctx, paths, layout)
    if ctx.is_main:
        publish(lambda path, **_: sums[path])
    barrier(ctx, fn)


def _is_shared(ctx: RunContext, paths: Sequence[Path], group: Any) -> bool:
    """True when every rank sees the files rank 0 created (one filesystem for all)."""
    seen = all(p.is_file() for p in paths)
    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, seen, group=group)
    return all(everyone)


def _stream_to_main(
    ctx: RunContext, paths: Sequence[Path], layout: Sequence[tuple[str, Mapping[str, torch.Tensor]]]
) -> dict[Path, tuple[int, int]]:
    """Ranks without the files: gather one tensor at a time (`full_tensor`, a collective every
    rank joins), which rank 0 writes in place. Return each file's (size, crc32)."""
    sums = {}
    for path, (_, tensors) in zip(paths, layout, strict=True):
        head = header_bytes(tensors, FILE_METADATA)
        crc, offset = zlib.crc32(head), len(head)
        fd = os.open(path, os.O_WRONLY) if ctx.is_main else -1
        try:
            for t in tensors.values():
                whole = t.full_tensor() if is_dtensor(t) else t  # one tensor at a time
                if ctx.is_main and whole.numel():
                    data = as_buffer(whole.detach().cpu().contiguous())
                    os.pwrite(fd, data, offset)
                    crc, offset = zlib.crc32(data, crc), offset + len(data)
                del whole
            if ctx.is_main:
                os.fsync(fd)
        finally:
            if fd >= 0:
                os.close(fd)
        sums[path] = (offset, crc)
    return sums
