"""The threaded CRC-32 that checkpoints verify with gives exactly zlib's value."""

from __future__ import annotations

import random
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accel.checkpoint._crc32 import combine, crc32


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
