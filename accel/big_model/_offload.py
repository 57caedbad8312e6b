"""Tensors that live on disk: read in place from a safetensors file, or from numpy memmaps that
accel writes (one `.dat` file per tensor plus `index.json`), always mapped lazily.

bf16 and float8 have no numpy dtype: they are stored and mapped as same-width integers and
viewed back as the torch dtype, bit for bit.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch

from accel._safetensors.header import DTYPES

INDEX = "index.json"
READ_CHUNK = 16 * 2**20
"""Bytes read at a time when a tensor is cast while loading."""

# numpy has no bf16 or float8: their bits are held in integers of the same width
_NUMPY_HOLDERS = MappingProxyType({"BF16": np.int16, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8})
# safetensors dtype name -> (torch dtype, numpy dtype that holds its bits)
ST_DTYPES = MappingProxyType(
    {
        name: (dtype, _NUMPY_HOLDERS.get(name) or torch.empty((), dtype=dtype).numpy().dtype.type)
        for name, dtype in DTYPES.items()
    }
)
TORCH_TO_ST = MappingProxyType({t: name for name, (t, _) in ST_DTYPES.items()})


@dataclass(frozen=True, slots=True)
class DiskTensor:
    """Where one tensor's bytes are in a file, and how to view them."""

    path: str
    """The file holding the bytes (a safetensors shard or a `.dat` memmap)."""
    offset: int
    """Byte offset of the first element in that file."""
    shape: tuple[int, ...]
    """The tensor's shape."""
    dtype: str
    """safetensors dtype name ("F32", "BF16", ...)."""

    def load(self) -> torch.Tensor:
        """Map the bytes (copy-on-write, nothing read until touched) as a CPU tensor."""
        torch_dtype, np_dtype = ST_DTYPES[self.dtype]
        if 0 in self.shape:
            return torch.empty(self.shape, dtype=torch_dtype)
        array = np.memmap(self.path, dtype=np_dtype, mode="c", offset=self.offset, shape=self.shape)
        tensor = torch.from_numpy(array)
        return tensor.view(torch_dtype) if tensor.dtype != torch_dtype else tensor

    def read_as(self, dtype: torch.dtype) -> torch.Tensor:
        """Read the bytes into a new CPU tensor of `dtype`, casting a chunk at a time.

        Each chunk is mapped, cast into place and unmapped, so the peak is the result plus one
        chunk, where mapping the whole tensor and casting it would hold the source as well
        (mapped pages count in the process's memory until they are unmapped).
        """
        source, np_dtype = ST_DTYPES[self.dtype]
        out = torch.empty(self.shape, dtype=dtype)
        flat = out.view(-1)
        step = max(1, READ_CHUNK // source.itemsize)
        for start in range(0, flat.numel(), step):
            count = min(step, flat.numel() - start)
            offset = self.offset + start * source.itemsize
            array = np.memmap(self.path, dtype=np_dtype, mode="c", offset=offset, shape=(count,))
            chunk = torch.from_numpy(array)
            flat[start : start + count].copy_(
                chunk.view(source) if chunk.dtype != source else chunk
            )
            del array, chunk  # unmapped here
        return out


@dataclass(frozen=True, slots=True)
class HeaderEntry:
    """One tensor of a safetensors header."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    """Absolute byte offset of the data in the file."""


def write_tensor(folder: Path, name: str, tensor: torch.Tensor) -> DiskTensor:
    """Write `tensor` to `folder/<name>.dat` as a raw memmap and say where it is."""
    st_dtype = TORCH_TO_ST[tensor.dtype]
    np_dtype = ST_DTYPES[st_dtype][1]
    path = folder / f"{name}.dat"
    shape = tuple(tensor.shape)
    if tensor.numel():
        holder = torch.from_numpy(np.empty(0, np_dtype)).dtype
        bits = tensor.detach().cpu().contiguous().view(holder)
        array = np.memmap(path, dtype=np_dtype, mode="w+", shape=shape)
        array[...] = bits.numpy()
        array.flush()
        del array
    else:
        path.touch()
    return DiskTensor(path=str(path), offset=0, shape=shape, dtype=st_dtype)


def write_index(folder: Path, tensors: Mapping[str, DiskTensor]) -> None:
    """Record every offloaded tensor's file, dtype and shape in `folder/index.json`."""
    index = {
        name: {"file": Path(t.path).name, "offset": t.offset, "dtype": t.dtype, "shape": t.shape}
        for name, t in tensors.items()
        if Path(t.path).parent == folder
    }
    (folder / INDEX).write_text(json.dumps(index, indent=1))


def read_index(folder: Path) -> dict[str, DiskTensor]:
    """The tensors recorded by `write_index` in `folder`."""
    index = json.loads((folder / INDEX).read_text())
    return {
        name: DiskTensor(str(folder / e["file"]), e["offset"], tuple(e["shape"]), e["dtype"])
        for name, e in index.items()
    }


def check_writable(fn: str, offload_dir: str | os.PathLike[str]) -> Path:
    """Create `offload_dir` if needed and prove a file can be written there."""
    folder = Path(offload_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".accel-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"{fn}: offload_dir={str(offload_dir)!r} is not writable ({err.strerror}). Pass a "
            "folder you can write to, on a disk with room for the offloaded weights."
        ) from err
    return folder
