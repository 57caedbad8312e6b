"""Safetensors I/O for sharded models (FSDP2, tensor parallel, both): each rank its own slices.

A DTensor's placements say which global indices a rank holds along each tensor dim: `Shard(d)`
and `_StridedShard(d)` (FSDP2 over tensor parallel) cut dim d, `Replicate()` keeps it whole.
Those index sets are computed here from the placements alone (no communication), by splitting
`arange(size)` of each dim exactly as torch splits the tensor. A slice of a row-major tensor is
then a set of contiguous byte runs in the file: one run for a row range, one per row for a
column range. Loading reads those runs with `preadv` straight into the local shard; saving
writes them with `pwritev` into a pre-sized file every rank opens (`_sharded_save`). No rank
reads, writes or holds any byte of a tensor it does not own, and nothing is gathered.

Checksums are computed split across ranks: each rank checksums 1/N of every file's bytes and
the parts combine (`_crc32.combine`) into the checksum of the whole file, so verifying a
checkpoint costs one read of it in total, not one per rank.
"""

from __future__ import annotations

import itertools
import os
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from accel._dtensor import is_dtensor
from accel._safetensors.crc32 import combine
from accel._safetensors.files import CheckpointFiles
from accel._safetensors.header import DTYPES, CorruptFileError, TensorEntry, read_header
from accel._safetensors.manifests import check_sum
from accel.checkpoint._model_io import check_against_model

# A contiguous byte run: (offset in the tensor's bytes in the file, offset in the local slice,
# length).
Run = tuple[int, int, int]
_VERIFY_CHUNK = 1 << 20  # bytes per checksum read: large enough for full disk speed


# ------------------------------------------------------------------------------ index sets


def local_indices(t: torch.Tensor) -> list[torch.Tensor]:
    """The global indices this rank holds along each dim of DTensor `t` (int64, ascending)."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    indices = [torch.arange(n) for n in t.shape]
    coordinate = t.device_mesh.get_coordinate()  # type: ignore[attr-defined]
    assert coordinate is not None, "a rank outside the mesh holds no slice"
    for axis, placement in enumerate(t.placements):  # type: ignore[attr-defined]
        if not _is_split(placement):
            continue  # Replicate / Partial: the whole dim
        num = t.device_mesh.size(axis)  # type: ignore[attr-defined]
        dim = placement.dim
        # Split a 1-D index vector the way torch splits dim `dim` of the tensor (torch.chunk
        # semantics, and the interleaving of _StridedShard), so uneven sizes match exactly.
        along = (
            _StridedShard(0, split_factor=placement.split_factor)
            if isinstance(placement, _StridedShard)
            else Shard(0)
        )
        parts, _ = along._split_tensor(indices[dim], num, with_padding=False)
        indices[dim] = parts[coordinate[axis]] if coordinate[axis] < len(parts) else parts[0][:0]
    return indices


def owns_copy(t: torch.Tensor) -> bool:
    """True on the one rank among replicas of this slice that should write it (coordinate 0)."""
    coordinate = t.device_mesh.get_coordinate()  # type: ignore[attr-defined]
    assert coordinate is not None
    return all(
        c == 0
        for c, p in zip(coordinate, t.placements, strict=True)  # type: ignore[attr-defined]
        if not _is_split(p)
    )


def _is_split(placement: Any) -> bool:
    # _StridedShard (FSDP2 over tensor parallel) answers is_shard() False: ask by type.
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    return isinstance(placement, Shard | _StridedShard)


def _spans(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """Contiguous runs of an ascending index vector: (first index, local position, length)."""
    if index.numel() == 0:
        return []
    values = index.tolist()
    spans = [(values[0], 0, 1)]
    for pos, v in enumerate(values[1:], start=1):
        first, at, length = spans[-1]
        if v == first + length:
            spans[-1] = (first, at, length + 1)
        else:
            spans.append((v, pos, 1))
    return spans


def byte_runs(shape: Sequence[int], indices: Sequence[torch.Tensor], itemsize: int) -> list[Run]:
    """The contiguous byte runs that hold the slice `indices` of a row-major tensor `shape`.

    Offsets are relative to the tensor's first byte in the file and to the local (contiguous)
    slice's first byte. The trailing dims a slice covers whole merge into each run.
    """
    if not shape:
        return [(0, 0, itemsize)]  # a scalar
    if any(i.numel() == 0 for i in indices):
        return []
    full = [i.numel() == n for i, n in zip(indices, shape, strict=True)]
    cut = max((d for d, whole in enumerate(full) if not whole), default=0)
    inner = itemsize
    for n in shape[cut + 1 :]:
        inner *= n
    global_strides = [inner]  # bytes per index step of dims cut, cut-1, ..., 0
    for n in reversed(shape[1 : cut + 1]):
        global_strides.insert(0, global_strides[0] * n)
    local_shape = [i.numel() for i in indices[: cut + 1]]
    local_strides = [inner]
    for n in reversed(local_shape[1:]):
        local_strides.insert(0, local_strides[0] * n)
    spans = _spans(indices[cut])
    runs: list[Run] = []
    outer = [range(len(i)) for i in indices[:cut]]
    outer_values = [i.tolist() for i in indices[:cut]]
    for pos in itertools.product(*outer):
        g = sum(outer_values[d][p] * global_strides[d] for d, p in enumerate(pos))
        loc = sum(p * local_strides[d] for d, p in enumerate(pos))
        for first, at, length in spans:
            runs.append((g + first * inner, loc + at * inner, length * inner))
    return runs


def merge_runs(runs: list[Run]) -> list[Run]:
    """Join runs adjacent in both the file and the local buffer (fewer system calls)."""
    merged: list[Run] = []
    for file_at, local_at, length in runs:
        if (
            merged
            and merged[-1][0] + merged[-1][2] == file_at
            and (merged[-1][1] + merged[-1][2] == local_at)
        ):
            merged[-1] = (merged[-1][0], merged[-1][1], merged[-1][2] + length)
        else:
            merged.append((file_at, local_at, length))
    return merged


def as_buffer(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ checksums


def split_checksums(paths: Sequence[Path], group: Any = None) -> list[tuple[int, int]]:
    """(size, crc32) of each file, every rank of `group` checksumming 1/N of its bytes."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    parts = []
    for path in paths:
        total = path.stat().st_size
        lo, hi = total * rank // size, total * (rank + 1) // size
        parts.append((_crc_range(path, lo, hi), hi - lo, total))
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, parts, group=group)
    out = []
    for i in range(len(paths)):
        value = 0
        for rank_parts in gathered:
            crc, length, total = rank_parts[i]
            value = combine(value, crc, length)
        out.append((total, value))
    return out


def _crc_range(path: Path, lo: int, hi: int) -> int:
    value = 0
    buffer = memoryview(bytearray(min(_VERIFY_CHUNK, hi - lo)))  # reused: memory stays flat
    fd = os.open(path, os.O_RDONLY)
    try:
        while lo < hi:
            got = os.preadv(fd, [buffer[: min(len(buffer), hi - lo)]], lo)
            if got == 0:
                break  # the file shrank under us: the size check reports it
            value = zlib.crc32(buffer[:got], value)
            lo += got
    finally:
        os.close(fd)
    return value


def verify(fn: str, files: Sequence[Path], expected: Mapping[Path, tuple[int, int] | None]) -> None:
    """Refuse (on every rank) a file whose size or checksum differs from the manifest."""
    checked = [p for p in files if expected.get(p) is not None]
    for path, (size, crc) in zip(checked, split_checksums(checked), strict=True):
        want = expected[path]
        assert want is not None
        check_sum(fn, path, want, size, crc)


# ------------------------------------------------------------------------------ loading


class _Entry:
    """Where one tensor lies in a checkpoint file (from a header the shared parser validated)."""

    def __init__(self, path: Path, data_start: int, entry: TensorEntry) -> None:
        self.path, self.dtype, self.shape = path, DTYPES[entry.dtype], list(entry.shape)
        self.offset, self.nbytes = data_start + entry.begin, entry.end - entry.begin

    @property
    def meta(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


def file_entries(fn: str, paths: Sequence[Path]) -> dict[str, _Entry]:
    """Every tensor of the files, read from headers checked by `accel._safetensors.header`."""
    entries: dict[str, _Entry] = {}
    for path in paths:
        header = read_header(fn, path)
        entries.update({k: _Entry(path, header.data_start, e) for k, e in header.tensors.items()})
    return entries


def load_sharded(
    fn: str,
    model: nn.Module,
    files: CheckpointFiles,
    expected: Mapping[Path, tuple[int, int] | None],
    *,
    device: torch.device,
    strict: bool,
) -> tuple[list[str], list[str]]:
    """Fill a sharded `model` in place from safetensors `files`, each rank reading its slices.

    Returns (missing keys, unexpected keys). Every rank must call it (checksums are split).
    """
    if any(v is not None for v in expected.values()):
        verify(fn, files.files, expected)
    entries = file_entries(fn, files.files)
    shapes = {k: e.meta for k, e in entries.items()}
    state = check_against_model(fn, model, shapes, strict=strict)  # shapes, keys, tied names
    source = {
        k: entries[k] if k in entries else _tied_source(k, state, shapes, entries) for k in state
    }
    _materialise(fn, model, state.keys(), device)
    own = model.state_dict(keep_vars=True)
    fds: dict[Path, int] = {}
    try:
        with torch.no_grad():
            for name in state:
                entry = source[name]
                fd = fds.get(entry.path)
                if fd is None:
                    fd = fds[entry.path] = os.open(entry.path, os.O_RDONLY)
                _read_into(fn, fd, entry, own[name])
    finally:
        for fd in fds.values():
            os.close(fd)
    own_keys = model.state_dict().keys()
    return sorted(own_keys - state.keys()), sorted(entries.keys() - own_keys)


def _tied_source(
    name: str,
    state: Mapping[str, torch.Tensor],
    shapes: Mapping[str, torch.Tensor],
    entries: Mapping[str, _Entry],
) -> _Entry:
    # check_against_model filled a tied alias with the tensor saved under the other name.
    for other, t in shapes.items():
        if t is state[name]:
            return entries[other]
    raise AssertionError(f"no source for {name!r}")


def _materialise(fn: str, model: nn.Module, loading: Any, device: torch.device) -> None:
    """Allocate a model built on meta (and sharded there) on `device`; keep its real tensors."""
    own = model.state_dict(keep_vars=True)
    meta = [k for k, t in own.items() if t.is_meta]
    if not meta:
        return
    lacking = sorted(set(meta) - set(loading))
    if lacking:
        raise ValueError(
            f"{fn}: the model's tensors {lacking[:10]} ({len(lacking)}) are on the meta device "
            "and the checkpoint does not hold them (non-persistent buffers?). Build the model "
            "with init_empty_weights(include_buffers=False) so buffers are computed on the CPU."
        )
    real = {k: t.detach().clone() for k, t in own.items() if not t.is_meta and k not in loading}
    model.to_empty(device=device)  # FSDP2 re-registers its sharded parameters on _apply
    with torch.no_grad():
        for k, t in model.state_dict(keep_vars=True).items():
            if k in real:
                (t.to_local() if is_dtensor(t) else t).copy_(
                    real[k].to_local() if is_dtensor(real[k]) else real[k]
                )


def _read_into(fn: str, fd: int, entry: _Entry, target: torch.Tensor) -> None:
    local = target.to_local() if is_dtensor(target) else target
    indices = (
        local_indices(target) if is_dtensor(target) else [torch.arange(n) for n in target.shape]
    )
    itemsize = entry.dtype.itemsize
    runs = merge_runs(byte_runs(entry.shape, indices, itemsize))
    # Read straight into host memory only (the device canary's cpu:0 is staged, as a GPU is).
    host = local.device == torch.device("cpu")
    direct = local.dtype == entry.dtype and local.is_contiguous() and host
    buffer = local if direct else torch.empty(local.shape, dtype=entry.dtype)
    view = as_buffer(buffer) if buffer.numel() else memoryview(b"")
    for file_at, local_at, length in runs:
        got = os.preadv(fd, [view[local_at : local_at + length]], entry.offset + file_at)
        if got != length:
            raise CorruptFileError(
                f"{fn}: {str(entry.path)!r} ended inside a tensor; it is truncated. Save it again."
            )
    if not direct:
        local.copy_(buffer)
