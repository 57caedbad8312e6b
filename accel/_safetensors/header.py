"""The one safetensors header parser, shared by every loader (load_state, load_checkpoint_in_model,
dispatch_checkpoint), and the check that names pickle checkpoints.

A header is read only after its length is bounded (safetensors' own 100 MB limit), so a damaged
or hostile file never makes a loader allocate gigabytes; its dtypes, shapes and data offsets are
validated (every byte of the data covered once, as safetensors requires) before any tensor is
built. Every error is a `CorruptFileError` naming the file and what is wrong with it.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

MAX_HEADER_BYTES = 100_000_000  # safetensors refuses larger headers too

DTYPES = MappingProxyType(
    {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
    }
)
ITEMSIZE = MappingProxyType({k: torch.empty((), dtype=v).element_size() for k, v in DTYPES.items()})
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


class CorruptFileError(ValueError):
    """A checkpoint file whose size, checksum or header does not match what was written."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a validated header."""

    dtype: str
    """safetensors dtype name ("F32", "BF16", ...), one of `DTYPES`."""
    shape: tuple[int, ...]
    """Non-negative dimensions."""
    begin: int
    """Offset of the first byte, from the start of the data (after the header)."""
    end: int
    """Offset one past the last byte, from the start of the data."""


@dataclass(frozen=True, slots=True)
class Header:
    """A validated safetensors header."""

    data_start: int
    """Absolute offset of the data: 8 + the header's length."""
    tensors: MappingProxyType[str, TensorEntry]
    """Tensor name -> entry, in the header's order."""


def bad_file(fn: str, path: Path, why: str) -> CorruptFileError:
    """The error for a file that is not valid safetensors, naming it and what is wrong."""
    return CorruptFileError(
        f"{fn}: {str(path)!r} is not a valid safetensors file ({why}); it is truncated, corrupt "
        "or not a safetensors file. Save it again or load an earlier checkpoint."
    )


def pickle_error(fn: str, path: Path) -> CorruptFileError:
    """The error for a pickle checkpoint (torch.save), with the command that converts it."""
    if path.name.startswith("pytorch_model"):  # Hugging Face's name for the pickled weights
        target = path.with_name(path.name.replace("pytorch_model", "model", 1))
        target = target.with_suffix(".safetensors")
    else:
        target = path.with_suffix(".safetensors")
    return CorruptFileError(
        f"{fn}: {str(path)!r} is a pickle checkpoint (torch.save format), which accel does not "
        "load: unpickling a file can run any code. Convert it to safetensors once, from a "
        'source you trust: python -c "import torch; from safetensors.torch import save_file; '
        f"save_file(torch.load('{path}', weights_only=True), '{target}')\" and load "
        f"{str(target)!r}."
    )


def looks_like_pickle(path: Path) -> bool:
    """True for the file names torch.save checkpoints go by (pytorch_model.bin, *.pt, ...)."""
    return path.suffix.lower() in PICKLE_SUFFIXES


def _is_pickle_bytes(prefix: bytes) -> bool:
    # torch.save writes a zip archive (since torch 1.6) or a raw pickle (protocol 2-5).
    return prefix.startswith(b"PK\x03\x04") or (
        len(prefix) >= 2 and prefix[0] == 0x80 and 2 <= prefix[1] <= 5
    )


def header_length(fn: str, path: Path, prefix: bytes, size: int) -> int:
    """The header length from a file's first 8 bytes, checked against the file's `size`."""
    if size < 8:
        raise bad_file(fn, path, f"{size} bytes, shorter than the 8-byte header length")
    n: int = struct.unpack("<Q", prefix[:8])[0]
    if n > MAX_HEADER_BYTES or n > size - 8:
        if _is_pickle_bytes(prefix):
            raise pickle_error(fn, path)
        limit = f"the {MAX_HEADER_BYTES}-byte limit" if n > MAX_HEADER_BYTES else f"{size} bytes"
        raise bad_file(fn, path, f"its header length {n} exceeds {limit}")
    return n


def parse_header(fn: str, path: Path, raw: bytes, size: int) -> Header:
    """Validate the JSON header `raw` of a file of `size` bytes; return its tensors."""
    data_len = size - 8 - len(raw)
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise bad_file(fn, path, f"its header is not UTF-8 text: {err.reason}") from None
    except RecursionError:
        raise bad_file(fn, path, "its header JSON is nested too deeply") from None
    except ValueError as err:
        raise bad_file(fn, path, f"its header is not valid JSON: {err}") from None
    if not isinstance(header, dict):
        raise bad_file(fn, path, f"its header is a JSON {type(header).__name__}, not an object")
    tensors: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise bad_file(fn, path, "its __metadata__ is not an object of strings")
            continue
        tensors[name] = _entry(fn, path, name, info, data_len)
    _check_coverage(fn, path, tensors, data_len)
    return Header(data_start=8 + len(raw), tensors=MappingProxyType(tensors))


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _entry(fn: str, path: Path, name: str, info: object, data_len: int) -> TensorEntry:
    if not isinstance(info, dict):
        raise bad_file(fn, path, f"the entry of tensor {name!r} is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        allowed = ", ".join(DTYPES)
        raise bad_file(fn, path, f"tensor {name!r} has dtype {dtype!r}; allowed: {allowed}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad_file(
            fn, path, f"tensor {name!r} has shape {shape!r}, not a list of non-negative integers"
        )
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_int(o) for o in offsets)
        and 0 <= offsets[0] <= offsets[1] <= data_len
    ):
        raise bad_file(
            fn, path, f"tensor {name!r} has data_offsets {offsets!r}; expected [begin, end] "
            f"with 0 <= begin <= end <= {data_len} (the bytes after the header)",
        )  # fmt: skip
    count = 1
    for d in shape:
        count *= d
    need = count * ITEMSIZE[dtype]
    if offsets[1] - offsets[0] != need:
        raise bad_file(
            fn, path, f"tensor {name!r} has data_offsets {offsets} spanning "
            f"{offsets[1] - offsets[0]} bytes, but {dtype}{shape} needs {need}",
        )  # fmt: skip
    return TensorEntry(dtype, tuple(shape), offsets[0], offsets[1])


def _check_coverage(fn: str, path: Path, tensors: dict[str, TensorEntry], data_len: int) -> None:
    position = 0
    for name, entry in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if entry.begin != position:
            what = "overlaps the tensor before it" if entry.begin < position else "leaves a gap"
            raise bad_file(fn, path, f"tensor {name!r} at data_offsets {entry.begin} {what}")
        position = entry.end
    if position != data_len:
        raise bad_file(
            fn, path, f"the tensors' data_offsets end at {position} but the file holds "
            f"{data_len} data bytes",
        )  # fmt: skip


def read_header(fn: str, path: Path) -> Header:
    """Read and validate a safetensors file's header from disk, without reading its data."""
    if looks_like_pickle(path):
        raise pickle_error(fn, path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        n = header_length(fn, path, prefix, size)
        raw = f.read(n)
    if len(raw) != n:
        raise bad_file(fn, path, f"it ended while its {n}-byte header was read")
    return parse_header(fn, path, raw, size)
