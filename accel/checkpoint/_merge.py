"""`accel merge-weights`: a sharded (DCP) checkpoint to the Hugging Face safetensors layout.

Streamed in one process: the files' headers come from DCP's metadata (global shapes and
dtypes), then each tensor alone is read from the DCP shards (DCP reads only the byte ranges
that hold it) and written in place, so memory is bounded by the largest tensor. The output is
published as `save_model` publishes: renamed into place, with an index and a manifest.
"""

from __future__ import annotations

import json
import os
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch

from accel._safetensors import manifests
from accel._safetensors.exports import export_lock, partial_path
from accel._size import parse_size
from accel.checkpoint import _atomic
from accel.checkpoint._dcp import DCP_DIR, _reader
from accel.checkpoint._model_io import (
    FILE_METADATA,
    file_layout,
    partials_removed_on_failure,
    publish_model_files,
)
from accel.checkpoint._safetensors_io import header_bytes
from accel.checkpoint._sharded_save import presize

_FN = "merge-weights"


def merge_weights(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    model: str | None = None,
    max_shard_size: int | str = "5GB",
) -> list[str]:
    """Write the weights of model `model` in the DCP checkpoint `src` to `dst`; return the keys.

    `src` is a `save_state` directory (its `dcp/` folder is read) or a DCP folder itself.
    `model` is the name the model was saved under; default: the only model in the checkpoint.
    """
    max_bytes = parse_size(_FN, "max_shard_size", max_shard_size, minimum=1)
    folder = _dcp_folder(Path(src))
    reader = _reader(folder)
    metadata = reader.read_metadata()
    prefix = _model_prefix(Path(src), metadata, model)
    tensors: dict[str, torch.Tensor] = {}
    for key, info in metadata.state_dict_metadata.items():
        if key.startswith(prefix) and hasattr(info, "size"):
            tensors[key[len(prefix) :]] = torch.empty(
                tuple(info.size), dtype=info.properties.dtype, device="meta"
            )
    if not tensors:
        raise ValueError(
            f"{_FN}: {str(src)!r} holds no tensors under {prefix!r}; pass --model with the name "
            "the model was saved under (save_state(ctx, dir, model=...) saves it as 'model')."
        )
    destination = Path(dst)
    destination.mkdir(parents=True, exist_ok=True)
    sums = {}
    layout = file_layout(tensors, max_bytes)
    with export_lock(destination):
        with partials_removed_on_failure(_FN, destination, [name for name, _ in layout]):
            for name, shard in layout:
                path = partial_path(destination / name)
                sums[path] = _stream_file(folder, path, shard, prefix)
        publish_model_files(
            _FN, destination, tensors, {}, max_bytes, write=lambda path, **_: sums[path]
        )
    return list(tensors)


def _dcp_folder(src: Path) -> Path:
    for folder in (src / DCP_DIR, src):
        if (folder / ".metadata").is_file():
            return folder
    raise FileNotFoundError(
        f"{_FN}: src={str(src)!r} is not a sharded checkpoint: neither it nor {DCP_DIR}/ in it "
        "holds DCP's .metadata. Pass a directory written by accel.save_state of a sharded model."
    )


def _model_prefix(src: Path, metadata: Any, model: str | None) -> str:
    if model is not None:
        return f"{model}."
    names = sorted({k.split(".", 1)[0] for k in metadata.state_dict_metadata})
    manifest = src / manifests.MANIFEST
    if manifest.is_file():
        names = list(json.loads(manifest.read_text()).get("dcp", names))
    if len(names) != 1:
        raise ValueError(
            f"{_FN}: {str(src)!r} holds several objects {names}; pass --model NAME to choose "
            "the model to merge."
        )
    return f"{names[0]}."


def _stream_file(
    folder: Path, path: Path, shard: dict[str, torch.Tensor], prefix: str
) -> tuple[int, int]:
    """Fill the pre-sized `path` one tensor at a time; return its (size, crc32)."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    presize(path, shard, FILE_METADATA)
    head = header_bytes(shard, FILE_METADATA)
    crc, offset = zlib.crc32(head), len(head)
    with open(path, "r+b") as f:
        for name, meta in shard.items():
            value = torch.empty(meta.shape, dtype=meta.dtype)
            with warnings.catch_warnings():
                # One plain process reading a sharded checkpoint is intended here.
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp_load({prefix + name: value}, storage_reader=_reader(folder))
            flat = value.reshape(-1).view(torch.uint8)
            data = flat.numpy().data if value.numel() else memoryview(b"")
            _atomic.write_at(f.fileno(), data, offset, path)
            crc, offset = zlib.crc32(data, crc), offset + len(data)
            del value
        os.fsync(f.fileno())
    return offset, crc
