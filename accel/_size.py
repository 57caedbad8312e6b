"""Byte sizes written as Hugging Face writes them: `max_memory` budgets and `max_shard_size`."""

from __future__ import annotations

import re
from types import MappingProxyType

_UNITS = MappingProxyType(
    {
        "": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
        "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
    }
)  # fmt: skip
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def parse_size(fn: str, arg: str, size: object, *, minimum: int = 0) -> int:
    """Bytes in `size`: an int, or a string such as "5GB", "500MB" or "2GiB".

    Strings read as Accelerate's `convert_file_size_to_int` reads them: "KB", "MB", "GB" are
    powers of 10, "KiB", "MiB", "GiB" powers of 2, in any case, but a decimal unit ending in a
    lowercase "b" counts bits ("500Mb" is 62.5 MB). "TB", "TiB", "B" and bare numbers, which
    Accelerate refuses, are read the same way.

    Args:
        fn: the public function asking, named in the error.
        arg: how the argument is written in that call (`max_shard_size`, `max_memory['cpu']`).
        size: the value the caller passed.
        minimum: the smallest number of bytes allowed.

    Returns:
        The size in bytes.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        nbytes = size
    else:
        match = _SIZE.fullmatch(size) if isinstance(size, str) else None
        unit = match[2].upper() if match else ""
        nbytes = int(float(match[1]) * _UNITS[unit]) if match and unit in _UNITS else -1
        if match and len(match[2]) == 2 and match[2].endswith("b"):  # "Mb": megabits
            nbytes //= 8
    if nbytes < minimum:
        raise ValueError(
            f"{fn}: {arg}={size!r} is not a size of at least {minimum} bytes; pass bytes as an "
            "int or a string such as '5GB', '500MB' or '2GiB' (a lowercase b means bits: "
            "'500Mb' is 62.5 MB)."
        )
    return nbytes
