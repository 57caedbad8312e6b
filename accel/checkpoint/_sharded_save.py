"""Saving a sharded model's safetensors files without gathering it: rank 0 pre-sizes each file
from global shapes, every rank writes its own slices into place (`pwritev`), and the files are
published as an unsharded save publishes them. Where the ranks do not share the folder's
filesystem, the tensors are streamed to rank 0 one at a time instead.
"""

from __future__ import annotations

import itertools
import os
import socket
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from accel._dtensor import is_dtensor
from accel._groups import barrier, every_rank_step, require_group
from accel._safetensors.crc32 import combine, usable_cpus
from accel._safetensors.exports import export_lock, fsync_path
from accel.checkpoint._atomic import write_at
from accel.checkpoint._model_io import FILE_METADATA, partial_path, partials_removed_on_failure
from accel.checkpoint._safetensors_io import CHUNK, Checksum, header_bytes
from accel.checkpoint._sharded_io import (
    as_buffer,
    byte_runs,
    local_indices,
    merge_runs,
    owns_copy,
    split_checksums,
)
from accel.context import RunContext

Piece = tuple[int, int, int]
"""A byte run a rank wrote into a file: (offset, length, crc32 of its bytes)."""
_MAX_COMBINED = 4096  # runs per file past which reading the file back checksums it faster


def presize(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    """Create `path` holding the header of `tensors` (global shapes) and room for their bytes."""
    with open(path, "wb") as f:
        f.write(header_bytes(tensors, metadata))
        f.truncate(file_size(tensors, metadata))


def file_size(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> int:
    """The size of the safetensors file of `tensors` (global shapes)."""
    data = sum(t.numel() * t.element_size() for t in tensors.values())
    return len(header_bytes(tensors, metadata)) + data


def write_slices(
    path: Path,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    *,
    is_main: bool,
    spare_core: bool = True,
) -> list[Piece] | None:
    """Write this rank's slices of `tensors` into the pre-sized `path` (not fsynced yet).

    A DTensor slice is written by one of its replicas; a plain tensor (the same on every rank)
    by the main rank, which also checksums the header. Returns the (offset, length, crc32) of
    each byte run written (in chunks of at most `CHUNK`), checksummed from memory while it is
    written (in a helper thread when this rank has a `spare_core`, else inline), or None once
    the runs are too many to combine (the file is then checksummed by reading it back).
    """
    head = header_bytes(tensors, metadata)
    crc = Checksum(each=True, pending=4, thread=spare_core)
    runs: list[tuple[int, int]] | None = [(0, len(head))] if is_main else []
    if is_main:
        crc.add(memoryview(head))
    fd = os.open(path, os.O_WRONLY)
    try:
        offset = len(head)
        for t in tensors.values():
            for file_at, view in _slices_to_write(t, is_main):
                if runs is not None and len(runs) >= _MAX_COMBINED:
                    runs = None  # too many to combine: the file is read back instead
                for start in range(0, len(view), CHUNK):
                    part, at = view[start : start + CHUNK], offset + file_at + start
                    if runs is None:
                        write_at(fd, part, at, path)
                    else:
                        runs.append((at, len(part)))
                        crc.write(fd, part, at, path)
            offset += t.numel() * t.element_size()
    finally:
        os.close(fd)
        values = crc.results()
    if runs is None:
        return None
    return [(at, length, value) for (at, length), value in zip(runs, values, strict=True)]


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
    its slices in place, then the ranks of each machine fsync the files between them (one
    fsync per file per machine, after all writes, as a one-process save does: the kernel
    writes back while the later files are written), and the checksums of the runs written
    combine into each file's checksum; otherwise the
    tensors are streamed to rank 0 one at a time, which writes them. Then rank 0 calls
    `publish(write)`, whose `write` returns the (size, crc32) of a file already written:
    renames into place, index and manifest. An error on any rank is raised on every rank
    (`every_rank_step`: it travels in the save's own gathers); rank 0 then removes the
    partial files.
    """
    fn = "save_model"
    group = require_group(ctx, fn) if ctx.world_size > 1 else None
    paths = [partial_path(directory / name) for name, _ in layout]
    # Only rank 0, which created the files, removes them on failure: another rank doing it
    # could still be at it when rank 0 creates them again for a save retried at once.
    mine = [name for name, _ in layout] if ctx.is_main else []
    with ExitStack() as lock:  # rank 0 holds the export lock until the files are published
        with partials_removed_on_failure(fn, directory, mine):
            created: Exception | None = None
            if ctx.is_main:
                try:
                    directory.mkdir(parents=True, exist_ok=True)
                    lock.enter_context(export_lock(directory))
                    for path, (_, tensors) in zip(paths, layout, strict=True):
                        presize(path, tensors, FILE_METADATA)
                except Exception as err:  # told to every rank by the survey, which raises on each
                    created = err
            barrier(ctx, fn)
            sums = _write_all_ranks(ctx, paths, layout, group, created)

        def finish() -> None:  # publish removes the partial files itself when it fails
            if ctx.is_main:
                publish(lambda path, **_: sums[path])

        every_rank_step(ctx, fn, finish)  # the closing barrier, telling every rank the outcome


def _write_all_ranks(
    ctx: RunContext,
    paths: Sequence[Path],
    layout: Sequence[tuple[str, Mapping[str, torch.Tensor]]],
    group: Any,
    created: Exception | None,
) -> dict[Path, tuple[int, int]]:
    """Every rank writes its slices into the pre-sized `paths` (or streams them to rank 0 where
    the ranks do not share the files); return each file's (size, crc32).

    A write error on any rank (`created`: rank 0's in creating the files) is raised on every
    rank by the next collective of the save, so that no rank waits for one that gave up.
    """
    shared, machines = _survey(ctx, paths, created)
    if not shared:
        return _stream_to_main(ctx, paths, layout)
    peers = [r for r, m in enumerate(machines) if m == machines[ctx.rank]]
    # A helper thread checksums while the rank writes, as a one-process save does, when the
    # machine has a core for it; with as many ranks as cores it would only contend.
    spare = usable_cpus() >= 2 * len(peers)

    def write() -> list[list[Piece] | None]:
        pieces = [
            write_slices(path, tensors, FILE_METADATA, is_main=ctx.is_main, spare_core=spare)
            for path, (_, tensors) in zip(paths, layout, strict=True)
        ]
        for path in paths[peers.index(ctx.rank) :: len(peers)]:
            fsync_path(path)  # flushes every rank's pages of the file on this machine
        return pieces

    everyone = every_rank_step(ctx, "save_model", write)  # a full disk fails every rank
    sizes = [file_size(tensors, FILE_METADATA) for _, tensors in layout]
    return _file_checksums(dict(zip(paths, sizes, strict=True)), everyone, group)


def _file_checksums(
    paths: Mapping[Path, int], everyone: Sequence[Sequence[list[Piece] | None]], group: Any
) -> dict[Path, tuple[int, int]]:
    """(size, crc32) of each file (path -> its size) from the checksums of the runs every rank
    wrote (`everyone`: each rank's runs of each file).

    The runs of a file, sorted, must tile it exactly; they then combine into the file's
    checksum with no byte read back. A file they do not tile (nothing written into a gap), or
    cut into so many runs that combining them costs more than reading (column slices, one run
    per row), is checksummed by reading it back, split across ranks.
    """
    sums: dict[Path, tuple[int, int]] = {}
    for i, (path, size) in enumerate(paths.items()):
        if any(rank_pieces[i] is None for rank_pieces in everyone):
            continue
        runs = sorted(run for rank_pieces in everyone for run in rank_pieces[i] or ())
        total = sum(length for _, length, _ in runs)
        tiled = all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(runs))
        if runs and runs[0][0] == 0 and tiled and total == size:
            value = 0
            for _, length, crc in runs:
                value = combine(value, crc, length)
            sums[path] = (total, value)
    rest = [p for p in paths if p not in sums]  # the same on every rank: computed from `everyone`
    if rest:
        sums.update(zip(rest, split_checksums(rest, group), strict=True))
    return sums


def _survey(
    ctx: RunContext, paths: Sequence[Path], created: Exception | None = None
) -> tuple[bool, list[str]]:
    """Whether every rank sees the files rank 0 created (one filesystem for all), and which
    machine each rank runs on (a page cache is per machine, so one fsync there flushes the
    pages every rank of that machine wrote). Raises rank 0's error in `created` on every rank."""
    everyone = every_rank_step(
        ctx, "save_model", lambda: (all(p.is_file() for p in paths), _machine()), failed=created
    )
    return all(s for s, _ in everyone), [m for _, m in everyone]


def _machine() -> str:
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}/{boot.read_text().strip() if boot.exists() else ''}"


def _stream_to_main(
    ctx: RunContext,
    paths: Sequence[Path],
    layout: Sequence[tuple[str, Mapping[str, torch.Tensor]]],
) -> dict[Path, tuple[int, int]]:
    """Ranks without the files: gather one tensor at a time (`full_tensor`, a collective every
    rank joins), which rank 0 writes in place. Return each file's (size, crc32).

    A write error stops rank 0's writing, not its part in the collectives; a gather at the end
    raises it on every rank.
    """
    sums = {}
    failure: OSError | None = None
    for path, (_, tensors) in zip(paths, layout, strict=True):
        head = header_bytes(tensors, FILE_METADATA)
        crc, offset = zlib.crc32(head), len(head)
        fd = -1
        try:
            if ctx.is_main and failure is None:
                fd = os.open(path, os.O_WRONLY)
        except OSError as err:  # from here on rank 0 only joins the collectives
            failure = err
        try:
            for t in tensors.values():
                whole = t.full_tensor() if is_dtensor(t) else t  # one tensor at a time
                if fd >= 0 and failure is None and whole.numel():
                    data = as_buffer(whole.detach().cpu().contiguous())
                    try:
                        write_at(fd, data, offset, path)
                    except OSError as err:  # a full disk, say
                        failure = err
                    crc, offset = zlib.crc32(data, crc), offset + len(data)
                del whole
            if fd >= 0 and failure is None:
                try:
                    os.fsync(fd)
                except OSError as err:
                    failure = err
        finally:
            if fd >= 0:
                os.close(fd)
        sums[path] = (offset, crc)
    every_rank_step(ctx, "save_model", lambda: None, failed=failure)
    return sums
