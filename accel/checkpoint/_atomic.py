"""Crash-safe directories: write into a hidden sibling, fsync, write a manifest, rename.

A checkpoint directory is complete exactly when it exists under its final name: it only gets
that name by an atomic `rename` after every file in it and the manifest were fsynced. A crash
at any moment leaves either the previous state or a `.<name>.partial` sibling, which readers
ignore and the next save removes.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import time
import zlib
from pathlib import Path
from typing import Any

import torch

from accel._version import __version__
from accel.checkpoint._crc32 import crc32

MANIFEST = "accel-manifest.json"
FORMAT = 1
_PARTIAL = ".partial"


def staging_dir(final: Path) -> Path:
    """The hidden sibling a save of `final` is written into."""
    return final.parent / f".{final.name}{_PARTIAL}"


def fsync_path(path: Path) -> None:
    """Make a written file's data, or a directory's entries (created, renamed files), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes, *, fsync: bool = True) -> tuple[int, int]:
    """Write (and by default fsync) a small file; return (size, crc32)."""
    with open(path, "wb") as f:
        f.write(data)
    if fsync:
        fsync_path(path)
    return len(data), zlib.crc32(data)


def checksum_file(path: Path) -> tuple[int, int]:
    """(size, crc32) of a file on disk."""
    size = path.stat().st_size
    if size == 0:
        return 0, 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            return size, crc32(view)
        finally:
            view.release()


def fresh_staging(final: Path) -> Path:
    """Create an empty staging directory for `final`, removing a crashed save's leftovers."""
    staging = staging_dir(final)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def publish(
    staging: Path, final: Path, entries: dict[str, list[int]], info: dict[str, Any]
) -> None:
    """Write the manifest, fsync, and rename `staging` to `final` (replacing an old `final`)."""
    manifest = {
        "format": FORMAT,
        "accel_version": __version__,
        "torch_version": torch.__version__,
        **info,
        "files": dict(sorted(entries.items())),
    }
    write_bytes(staging / MANIFEST, json.dumps(manifest, indent=1).encode())
    for sub in sorted({p.parent for p in staging.rglob("*")} | {staging}, reverse=True):
        fsync_path(sub)
    old = final.parent / f".{final.name}.old"
    if final.exists():
        # Not atomic for a directory saved twice under one name: between the two renames the
        # name is missing (never half-written). Numbered checkpoints never take this path.
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
    staging.rename(final)
    fsync_path(final.parent)
    if old.exists():
        shutil.rmtree(old)


def read_manifest(fn: str, directory: Path) -> dict[str, Any]:
    """The manifest of a published directory; raises naming the directory when absent."""
    path = directory / MANIFEST
    if not directory.is_dir():
        raise FileNotFoundError(f"{fn}: directory={str(directory)!r} does not exist.")
    if not path.is_file():
        raise FileNotFoundError(
            f"{fn}: {str(directory)!r} has no {MANIFEST}, so it is not a complete accel "
            "checkpoint (a save was interrupted, or it was written by something else). Use "
            "accel.latest_checkpoint(root) to find the newest complete one."
        )
    try:
        manifest: Any = json.loads(path.read_text())
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise TypeError
    except (ValueError, TypeError):
        raise ValueError(f"{fn}: {str(path)!r} is not a valid accel manifest.") from None
    return manifest


def expected(manifest: dict[str, Any], rel: str) -> tuple[int, int] | None:
    """(size, crc32) the manifest recorded for `rel`, or None when it lists no such file."""
    entry = manifest["files"].get(rel)
    return None if entry is None else (int(entry[0]), int(entry[1]))


def wait_for_files(paths: list[Path], timeout_s: float) -> None:
    """Wait until every path exists (other ranks' markers on a shared filesystem)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            missing = [str(p) for p in paths if not p.exists()]
            raise TimeoutError(
                f"save_state: ranks did not finish writing within {timeout_s:.0f}s ({missing}); "
                "a rank died or the ranks do not share the checkpoint filesystem."
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
