"""Model exports (the Hugging Face layout `save_model` writes) to and from a store.

Loading: the checkpoint's files (a `.safetensors` file, an index and its shards, or a folder of
either) are downloaded into a local folder, each checked against the accel manifest beside them
when there is one, and the local loaders read them there.

Publishing: the files `save_model` wrote into a local folder are uploaded with the manifest last,
which is the commit. The file names are Hugging Face's, so a new export cannot go under other
names than the one it replaces: the old manifest is deleted first, then the new files uploaded
(each checked), then the new manifest; the old export's files of another layout go last. A kill
midway leaves the folder with no manifest, which accel's loaders refuse rather than load a mix
of two exports.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

from accel._safetensors.exports import OWN_FILES
from accel._safetensors.files import INDEX_NAME, SINGLE_NAME
from accel._safetensors.manifests import MANIFEST
from accel._store.transfer import (
    download,
    file_blob,
    get_bytes,
    listing,
    put_bytes,
    remove,
    upload,
)
from accel._store.urls import Remote


def fetch_export(fn: str, remote: Remote, folder: Path) -> Path:
    """Download the model checkpoint at `remote` into `folder`; return the local path that
    stands for it (the file, the index, or `folder` itself)."""
    if remote.path.endswith((".safetensors", ".json")):
        base, name = remote.parent, remote.name
        manifest = _manifest(fn, base, folder)
        wanted = [name]
        if name.endswith(".json"):
            download(fn, base, {name: _expected(manifest, name)}, folder)
            wanted = _shards(fn, remote.url, folder / name)
        download(fn, base, {n: _expected(manifest, n) for n in wanted}, folder)
        return folder / name
    objects = listing(fn, remote)
    if not objects:
        raise FileNotFoundError(f"{fn}: checkpoint={remote.url!r} does not exist (no objects).")
    manifest = _manifest(fn, remote, folder) if MANIFEST in objects else None
    if INDEX_NAME in objects:
        download(fn, remote, {INDEX_NAME: _expected(manifest, INDEX_NAME)}, folder)
        names = _shards(fn, remote.url_of(INDEX_NAME), folder / INDEX_NAME)
    elif SINGLE_NAME in objects:
        names = [SINGLE_NAME]
    else:  # one .safetensors file of another name, as the local loader accepts
        names = [n for n in objects if "/" not in n and n.endswith(".safetensors")][:2]
        if len(names) != 1:
            raise FileNotFoundError(
                f"{fn}: checkpoint={remote.url!r} holds no {INDEX_NAME} or {SINGLE_NAME} and "
                f"{len(names)} .safetensors files; pass the URL of the file or index to load."
            )
    download(fn, remote, {n: _expected(manifest, n) for n in names}, folder)
    return folder


def _manifest(fn: str, remote: Remote, folder: Path) -> dict[str, Any] | None:
    data = get_bytes(fn, remote, MANIFEST)
    if data is None:
        return None
    (folder / MANIFEST).write_bytes(data)
    manifest: Any = json.loads(data)
    return manifest if isinstance(manifest, dict) else None


def _expected(manifest: dict[str, Any] | None, name: str) -> tuple[int, int] | None:
    entry = (manifest or {}).get("files", {}).get(name)
    return None if entry is None else (int(entry[0]), int(entry[1]))


def _shards(fn: str, url: str, index: Path) -> list[str]:
    """The shard names an index names, each a plain name beside it (nothing else is fetched)."""
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
        names = sorted({str(v) for v in weight_map.values()})
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(
            f"{fn}: {url!r} is not a safetensors index (a JSON object with a 'weight_map' of "
            "tensor name -> file name)."
        ) from None
    for name in names:
        part = PurePosixPath(name)
        if part.is_absolute() or len(part.parts) != 1 or name in (".", ".."):
            raise ValueError(
                f"{fn}: the index {url!r} names {name!r}, not a file beside it; an index may "
                "only name files beside it. Refusing to read it."
            )
    return names


def publish_export(fn: str, folder: Path, remote: Remote) -> None:
    """Upload the export `save_model` wrote into `folder` to `remote`: the old manifest deleted
    first, the files uploaded and checked, the manifest last, the old export's other files
    removed (only names an export writes)."""
    manifest = json.loads((folder / MANIFEST).read_bytes())
    files = {n: file_blob(folder / n, size, crc) for n, (size, crc) in manifest["files"].items()}
    before = listing(fn, remote)
    remove(fn, remote, [MANIFEST] if MANIFEST in before else [])
    upload(fn, remote, files)
    put_bytes(fn, remote, MANIFEST, (folder / MANIFEST).read_bytes())
    stale = [n for n in before if OWN_FILES.fullmatch(n) and n not in manifest["files"]]
    remove(fn, remote, sorted(stale, key=lambda n: (n != INDEX_NAME, n)))
