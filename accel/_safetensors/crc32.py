"""zlib's CRC-32 of a large buffer, computed on several threads.

`zlib.crc32` releases the GIL on large buffers, so chunks checksummed in threads run in
parallel. The parts combine into the value a single `zlib.crc32` pass gives: the CRC of A + B
is the CRC of A carried through len(B) zero bytes, XOR the CRC of B, and carrying a CRC through
n zero bytes is a multiplication by x^(8n) modulo the CRC polynomial (square-and-multiply in
GF(2), about a hundred microseconds of Python per distinct chunk length).
"""

from __future__ import annotations

import functools
import os
import threading
import zlib

_POLY = 0xEDB88320  # the CRC-32 polynomial, bit-reflected: bit 31 holds x^0, bit 0 holds x^31
_ONE = 1 << 31  # the polynomial 1
_X8 = 1 << 23  # the polynomial x^8: one byte's shift
_MAX_THREADS = 8  # past this, memory bandwidth is the limit, not the CRC
# Bytes copied or written, then checksummed, at a time: small enough to be still in the core's
# cache when checksummed (from memory afresh the checksum costs about twice as much).
PIECE = 256 << 10


def _multiply(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial, both bit-reflected."""
    product = 0
    for _ in range(32):
        if a & _ONE:
            product ^= b
        a = (a << 1) & 0xFFFFFFFF
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


@functools.lru_cache(maxsize=256)  # runs of one length (rows of a slice) share their shift
def _shift(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the CRC polynomial."""
    result, square = _ONE, _X8
    while nbytes:
        if nbytes & 1:
            result = _multiply(result, square)
        square = _multiply(square, square)
        nbytes >>= 1
    return result


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The CRC-32 of A + B from the CRC-32 of A, the CRC-32 of B and B's length in bytes."""
    return _multiply(_shift(len_b), crc_a) ^ crc_b


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def crc32(data: memoryview, *, chunk: int = 8 << 20, into: memoryview | None = None) -> int:
    """`zlib.crc32(data)`, with chunks of `chunk` bytes checksummed on up to 8 threads.

    With `into` (as long as `data`), `data` is also copied into it, each piece checksummed
    (from the copy) right after it is copied, while it is still in the core's cache: the bytes
    are read from memory once rather than once to copy and once to checksum.
    """
    starts = range(0, len(data), chunk)
    workers = min(len(starts), usable_cpus(), _MAX_THREADS)
    if (workers <= 1 and into is None) or not starts:
        if into is not None:
            into[:] = data
        return zlib.crc32(data)
    parts = [0] * len(starts)
    if into is not None:
        import numpy as np  # accel imports on use (numpy's copy releases the GIL)

        source, target = np.frombuffer(data, np.uint8), np.frombuffer(into, np.uint8)

    def checksum(lo: int, hi: int) -> int:
        if into is None:
            return zlib.crc32(data[lo:hi])
        value = 0
        for start in range(lo, hi, PIECE):
            end = min(start + PIECE, hi)
            np.copyto(target[start:end], source[start:end])
            value = zlib.crc32(into[start:end], value)
        return value

    def work(first: int) -> None:
        for i in range(first, len(starts), workers):
            parts[i] = checksum(starts[i], min(starts[i] + chunk, len(data)))

    # Plain threads rather than concurrent.futures, whose pools refuse work once the interpreter
    # is shutting down, which is when a background save may still be running.
    helpers = [
        threading.Thread(target=work, args=(k,), name="accel-crc32") for k in range(1, workers)
    ]
    for t in helpers:
        t.start()
    work(0)
    for t in helpers:
        t.join()
    value, full = parts[0], _shift(chunk)
    for start, part in zip(starts[1:], parts[1:], strict=True):
        length = min(chunk, len(data) - start)
        value = _multiply(full if length == chunk else _shift(length), value) ^ part
    return value
