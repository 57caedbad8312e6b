"""Find the safetensors files of a checkpoint: one file, an index, or a folder holding either.

Shared by `load_checkpoint_in_model`, `dispatch_checkpoint` and `load_state`. An index may only
name files beside it: `../` and absolute paths are refused before anything is opened.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Any

from accel._safetensors import manifests
from accel._safetensors.exports import settle
from accel._safetensors.header import (
    Header,
    looks_like_pickle,
    pickle_error,
    read_header,
)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True, slots=True)
class CheckpointFiles:
    """The files of a checkpoint and, for a sharded one, which file holds each tensor."""

    files: tuple[Path, ...]
    """Every safetensors file, in the order they should be read."""
    weight_map: MappingProxyType[str, Path] | None
    """Tensor name -> file, from the index; None for a single file (read its header)."""


def resolve_checkpoint(fn: str, checkpoint: str | os.PathLike[str]) -> CheckpointFiles:
    """Resolve `checkpoint` (a .safetensors file, an index .json, or a folder) to its files.

    Raises:
        FileNotFoundError: the path, or a shard the index names, does not exist.
        ValueError: an index that is not JSON, lacks `weight_map`, or names a path outside
            its folder.
    """
    path = Path(checkpoint)
    settle(fn, path if path.is_dir() else path.parent)  # an export a kill left half renamed
    if path.is_dir():
        folder = path
        if (path / INDEX_NAME).is_file():
            path = path / INDEX_NAME
        elif (path / SINGLE_NAME).is_file():
            path = path / SINGLE_NAME
        else:
            found = sorted(p.name for p in path.glob("*.safetensors"))
            pickles = sorted(p for p in path.iterdir() if looks_like_pickle(p))
            if not found and pickles:
                raise pickle_error(fn, pickles[0])
            if len(found) != 1:
                raise FileNotFoundError(
                    f"{fn}: checkpoint={str(checkpoint)!r} is a folder with no {INDEX_NAME} or "
                    f"{SINGLE_NAME} and {len(found)} .safetensors files {found[:5]}; pass the "
                    "file or index to load."
                )
            path = path / found[0]
        check_inside(fn, path, folder)
    if not path.exists():
        raise FileNotFoundError(f"{fn}: checkpoint={str(checkpoint)!r} does not exist.")
    if looks_like_pickle(path):
        raise pickle_error(fn, path)
    if path.suffix == ".json":
        return _read_index(fn, path)
    return CheckpointFiles(files=(path,), weight_map=None)


def check_inside(fn: str, path: Path, folder: Path) -> None:
    """Refuse `path` when it leads (through a symbolic link) outside the checkpoint `folder`.

    A checkpoint copied from elsewhere could otherwise read any file on the machine into the
    weights. The Hugging Face hub cache's own links (`snapshots/<rev>/x -> ../../blobs/<sha>`)
    are allowed.
    """
    target, base = path.resolve(), folder.resolve()
    if target == base or base in target.parents:
        return
    if (
        folder.parent.name == "snapshots"
        and target.parent == (folder.parent.parent / "blobs").resolve()
    ):
        return
    raise ValueError(
        f"{fn}: {str(path)!r} is a symbolic link to {str(target)!r}, outside the checkpoint "
        f"folder {str(folder)!r}; accel reads only files inside it. Copy the file into the "
        "folder instead of linking it (or save the checkpoint again)."
    )


def _read_index(fn: str, index: Path) -> CheckpointFiles:
    try:
        data: Any = json.loads(index.read_bytes())
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError, RecursionError):  # not JSON, not UTF-8, too deep
        raise ValueError(
            f"{fn}: {str(index)!r} is not a safetensors index (a JSON object with a "
            "'weight_map' of tensor name -> file name)."
        ) from None
    resolved: dict[str, Path] = {}
    files: dict[Path, None] = {}
    for name, file in weight_map.items():
        relative = PurePosixPath(str(file))
        if relative.is_absolute() or ".." in relative.parts or "\\" in str(file):
            raise ValueError(
                f"{fn}: the index {str(index)!r} maps {name!r} to {file!r}, outside the "
                "checkpoint folder; an index may only name files beside it. Refusing to read it."
            )
        shard = index.parent / relative
        if shard not in files:
            check_inside(fn, shard, index.parent)
        if shard not in files and not shard.is_file():
            raise FileNotFoundError(
                f"{fn}: shard {file!r} named by {str(index)!r} (for {name!r}) is missing; the "
                "checkpoint is incomplete. Copy the missing file or save the checkpoint again."
            )
        files[shard] = None
        resolved[name] = shard
    return CheckpointFiles(files=tuple(files), weight_map=MappingProxyType(resolved))


def verified_headers(fn: str, files: CheckpointFiles) -> dict[Path, Header]:
    """Each file's validated header; with an accel manifest beside them, sizes and crc32 too.

    For loaders that read tensors lazily (dispatch_checkpoint): every byte is checked against
    the manifest up front, so a flipped bit is refused before any weight is placed.
    """
    folder = files.files[0].parent
    has_manifest = (folder / manifests.MANIFEST).is_file()
    manifest = manifests.read_manifest(fn, folder) if has_manifest else None
    headers = {}
    for path in files.files:
        headers[path] = read_header(fn, path)
        if manifest is not None and manifests.expected(manifest, path.name) is not None:
            manifests.check_file(fn, path, manifest, path.name)
    return headers
