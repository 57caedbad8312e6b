"""The threaded CRC-32 that checkpoints verify with gives exactly zlib's value."""

from __future__ import annotations

import os
import random
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accel._safetensors.crc32 import combine, crc32


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=300))
def test_combining_two_parts_gives_the_crc_of_their_concatenation(a: bytes, b: bytes) -> None:
    assert combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.mark.parametrize("chunk", [1, 3, 64, 4096, 1 << 20])
@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 4096 * 3 + 17])
def test_threaded_crc32_equals_zlib_for_any_chunking(size: int, chunk: int) -> None:
    data = random.Random(size * 31 + chunk).randbytes(size)
    assert crc32(memoryview(data), chunk=chunk) == zlib.crc32(data)


def test_a_flipped_bit_anywhere_changes_the_threaded_crc32() -> None:
    data = bytearray(random.Random(0).randbytes(9 * 1024 + 5))
    clean = crc32(memoryview(data), chunk=1024)
    for position in (0, 1023, 1024, 5000, len(data) - 1):
        data[position] ^= 0x10
        assert crc32(memoryview(data), chunk=1024) != clean, position
        data[position] ^= 0x10
    assert crc32(memoryview(data), chunk=1024) == clean


@pytest.mark.parametrize("thread", [True, False], ids=["helper-thread", "inline"])
@pytest.mark.parametrize("each", [True, False], ids=["each-chunk", "running"])
def test_checksum_write_writes_every_byte_and_checksums_what_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, thread: bool, each: bool
) -> None:
    from accel.checkpoint import _safetensors_io

    monkeypatch.setattr(_safetensors_io, "PIECE", 7)  # inline: several pieces per chunk
    rng = random.Random(3)
    chunks = [rng.randbytes(n) for n in (0, 1, 7, 8, 50, 13)]
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    crc = _safetensors_io.Checksum(each=each, thread=thread)
    offset = 0
    try:
        for chunk in chunks:
            crc.write(fd, memoryview(chunk), offset, path)
            offset += len(chunk)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(chunks)
    if each:
        assert crc.results() == [zlib.crc32(c) for c in chunks]
    else:
        assert crc.result() == zlib.crc32(b"".join(chunks))


@pytest.mark.parametrize("chunk", [1, 64, 1 << 20])
@pytest.mark.parametrize("size", [0, 1, 63, 4096 * 3 + 17])
def test_crc32_into_copies_every_byte_and_checksums_the_copy(
    monkeypatch: pytest.MonkeyPatch, size: int, chunk: int
) -> None:
    import accel._safetensors.crc32 as crc32_module

    monkeypatch.setattr(crc32_module, "PIECE", 5)  # several pieces per chunk
    data = random.Random(size + chunk).randbytes(size)
    into = bytearray(size)
    assert crc32(memoryview(data), chunk=chunk, into=memoryview(into)) == zlib.crc32(data)
    assert bytes(into) == data
