"""Read and write safetensors files straight from tensor memory, with a CRC32 of every byte.

The format (https://github.com/huggingface/safetensors#format): 8 bytes little-endian header
length, a JSON header (padded with spaces to a multiple of 8), then the raw tensor bytes in
header order. Writing it here, rather than through `safetensors.torch.save_file`, lets each
tensor's bytes go to the file without an intermediate copy, lets the checksum run in a second
thread while the write runs (`zlib.crc32` and `file.write` both release the GIL on large
buffers), and lets the reader check the checksum on the bytes it reads anyway. Files written
here are ordinary safetensors files: `safetensors.torch.load_file` reads them.
"""

from __future__ import annotations

import json
import mmap
import queue
import struct
import threading
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType

import torch

from accel._safetensors.crc32 import PIECE, crc32
from accel._safetensors.exports import fsync_path
from accel._safetensors.header import (
    DTYPES,
    ITEMSIZE,
    header_length,
    looks_like_pickle,
    parse_header,
    pickle_error,
)
from accel._safetensors.manifests import check_sum
from accel.checkpoint._atomic import write_at

# Chunk size for writes, reads and checksums: large enough that syscalls and thread hand-offs
# cost nothing measurable, small enough to keep the checksum overlapped with the I/O.
CHUNK = 8 << 20

NAMES = MappingProxyType({v: k for k, v in DTYPES.items()})


def as_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def header_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in NAMES:
            raise TypeError(f"safetensors cannot store {name!r} of dtype {t.dtype}.")
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _chunks(views: list[memoryview]) -> Iterator[memoryview]:
    for v in views:
        for start in range(0, len(v), CHUNK):
            yield v[start : start + CHUNK]


class Checksum:
    """crc32 computed in a helper thread, in submission order, while the caller writes.

    One running value over every chunk added (`result`), or with `each=True` one value per
    chunk (`results`). `pending` bounds how many chunks may wait (`add` blocks beyond it), so
    a writer whose chunks are copies (a GPU shard brought to the CPU) holds only that many.
    With `thread=False` each chunk is checksummed in `add` itself (no spare core to use).
    A plain thread and queue rather than concurrent.futures, whose pools refuse work once the
    interpreter begins shutting down, which is when a background save may still be running.
    """

    def __init__(self, *, each: bool = False, pending: int = 0, thread: bool = True) -> None:
        self.value = 0
        self.values: list[int] = []
        self._each = each
        self._queue: queue.Queue[memoryview | None] = queue.Queue(maxsize=pending)
        self._thread = None
        if thread:
            self._thread = threading.Thread(target=self._run, name="accel-crc32", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while (chunk := self._queue.get()) is not None:
            self._checksum(chunk)

    def _checksum(self, chunk: memoryview) -> None:
        if self._each:
            self.values.append(zlib.crc32(chunk))
        else:
            self.value = zlib.crc32(chunk, self.value)

    def add(self, chunk: memoryview) -> None:
        if self._thread is None:
            self._checksum(chunk)
        else:
            self._queue.put(chunk)

    def write(self, fd: int, chunk: memoryview, offset: int, path: Path) -> None:
        """Write `chunk` at `offset` of `fd` (open on `path`) and add it: the helper thread
        checksums it during the write; inline, each piece is checksummed right after it is
        written, while it is still in the cache."""
        if self._thread is not None:
            self._queue.put(chunk)
            write_at(fd, chunk, offset, path)
            return
        value = 0 if self._each else self.value
        for start in range(0, len(chunk), PIECE):
            piece = chunk[start : start + PIECE]
            write_at(fd, piece, offset + start, path)
            value = zlib.crc32(piece, value)
        if self._each:
            self.values.append(value)
        else:
            self.value = value

    def result(self) -> int:
        """The running crc32, once every chunk added is done (ends the thread)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        return self.value

    def results(self) -> list[int]:
        """The crc32 of each chunk added (with `each=True`), once all are done."""
        self.result()
        return self.values


class PendingWrite:
    """A file whose bytes are written (not fsynced) while its crc32 may still be running."""

    def __init__(self, size: int, checksum: Checksum) -> None:
        self.size = size
        self._checksum = checksum

    def result(self) -> tuple[int, int]:
        """(size, crc32), once the checksum thread has finished."""
        return self.size, self._checksum.result()


def start_write(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> PendingWrite:
    """Write `tensors` (CPU) to `path`, checksumming in a second thread; do not fsync.

    Returns before the checksum of the last chunks is done, so that the caller's fsync (the
    disk's time) overlaps with it.
    """
    views = [memoryview(header_bytes(tensors, metadata))] + [as_bytes(t) for t in tensors.values()]
    crc = Checksum()
    size = 0
    try:
        with open(path, "wb", buffering=0) as f:
            for chunk in _chunks(views):
                crc.write(f.fileno(), chunk, size, path)  # overlapped with the write
                size += len(chunk)
    except BaseException:
        crc.result()  # stop the thread
        raise
    return PendingWrite(size, crc)


def write_file(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> tuple[int, int]:
    """Write `tensors` (CPU) to `path` and fsync it; return (size, crc32)."""
    pending = start_write(path, tensors, metadata)
    fsync_path(path)
    return pending.result()


def read_file(
    fn: str, path: Path, expected: tuple[int, int] | None, *, copy: bool = False
) -> dict[str, torch.Tensor]:
    """Map a safetensors file; check size and crc32 when `expected` is given; return tensors.

    The file is mapped copy-on-write (as `safetensors.torch.load_file` does) and the checksum
    runs on several threads. Without `copy` the tensors view the mapping: right for weights that
    are copied into a model at once. With `copy` the bytes are copied into private memory
    (checksummed piece by piece from the copy as it is made) and the mapping is dropped, for
    state an object keeps (an optimizer's moments): otherwise its first update would pay a
    copy-on-write fault per page, and the mapping would pin the file's disk space after a
    rotation deletes it.
    """
    size = path.stat().st_size
    if expected is not None:
        check_sum(fn, path, expected, size)  # before anything is read
    if size == 0:
        return parse(fn, path, torch.empty(0, dtype=torch.uint8))
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    buf = torch.frombuffer(mapped, dtype=torch.uint8)
    if expected is None:
        return parse(fn, path, buf.clone() if copy else buf)
    mapped_view = memoryview(buf.numpy())  # type: ignore[arg-type]
    if copy:  # copied and checksummed in one read: the checksum is of the copy kept
        buf = torch.empty_like(buf)
        into = memoryview(buf.numpy())  # type: ignore[arg-type]
        crc = crc32(mapped_view, chunk=CHUNK, into=into)
        into.release()
    else:
        crc = crc32(mapped_view, chunk=CHUNK)
    mapped_view.release()
    check_sum(fn, path, expected, size, crc)
    return parse(fn, path, buf)


def parse(fn: str, path: Path, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """Split a whole safetensors file held in `buf` (uint8) into tensors viewing it."""
    size = buf.numel()
    if looks_like_pickle(path):
        raise pickle_error(fn, path)
    prefix = bytes(buf[:8].numpy())
    n = header_length(fn, path, prefix, size)
    header = parse_header(fn, path, bytes(buf[8 : 8 + n].numpy()), size)
    data = buf[header.data_start :]
    out: dict[str, torch.Tensor] = {}
    for name, entry in header.tensors.items():
        dtype = DTYPES[entry.dtype]
        raw = data[entry.begin : entry.end]
        if (header.data_start + entry.begin) % ITEMSIZE[entry.dtype]:
            raw = raw.clone()  # misaligned in the file: copy to an aligned buffer
        out[name] = raw.view(dtype).reshape(entry.shape)
    return out
