"""accel's manifest: the sizes and crc32 of every file of a published folder, written last.

A folder with a manifest is complete; a reader checks each file it reads against its entry,
with `check_file` (which reads the file) or, where the reader checksums the bytes it reads
anyway (while copying them, piece by piece, split across ranks), with `check_sum`. Either way
a mismatch is one `CorruptFileError` with one message.
"""

from __future__ import annotations

import json
import mmap
import stat
from pathlib import Path
from typing import Any

from accel._safetensors.crc32 import crc32
from accel._safetensors.header import CorruptFileError

MANIFEST = "accel-manifest.json"
FORMAT = 1


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


# What Accelerate's save_state writes (model.safetensors or pytorch_model.bin, model_1.* for a
# second model, optimizer.bin, scheduler.bin, random_states_<rank>.pkl, ...).
_ACCELERATE_WEIGHTS = ("model*.safetensors", "pytorch_model*.bin")
_ACCELERATE_STATE = ("random_states_*.pkl", "optimizer*.bin", "scheduler*.bin")


def _accelerate_folder(fn: str, directory: Path) -> str | None:
    """The message for a folder Accelerate's save_state wrote, or None for any other folder."""
    weights = sorted(p.name for pattern in _ACCELERATE_WEIGHTS for p in directory.glob(pattern))
    state = sorted(p.name for pattern in _ACCELERATE_STATE for p in directory.glob(pattern))
    if not state:
        return None
    model = weights[0] if weights else "model.safetensors"
    # Each .bin is the state_dict of the object its name starts with (optimizer_1.bin: the
    # second optimizer), loaded by that object.
    loads = [
        f"{name.partition('_')[0].removesuffix('.bin')}.load_state_dict(torch.load("
        f"{str(directory / name)!r}, weights_only=True))"
        for name in state
        if name.endswith(".bin")
    ]
    others = f"; then {'; '.join(loads)}" if loads else ""
    return (
        f"{fn}: {str(directory)!r} has no {MANIFEST}: it is a folder written by Accelerate's "
        f"save_state ({', '.join(weights + state)}), which accel's load_state does not read. "
        f"Load its weights with accel.load_checkpoint_in_model(model, "
        f"{str(directory / model)!r}){others} (docs/migration.md)."
    )


def read_manifest(fn: str, directory: Path) -> dict[str, Any]:
    """The manifest of a published directory; raises naming the directory or the manifest."""
    path = directory / MANIFEST
    try:  # one stat: a folder rotated away between two checks must not read as a file
        is_folder: bool | None = stat.S_ISDIR(directory.stat().st_mode)
    except FileNotFoundError:
        is_folder = None
    if is_folder is False:
        raise NotADirectoryError(
            f"{fn}: directory={str(directory)!r} is a file, not a checkpoint folder. Pass the "
            "folder save_state wrote (or accel.latest_checkpoint(root) for numbered ones)."
        )
    if is_folder is None:
        raise FileNotFoundError(
            f"{fn}: directory={str(directory)!r} does not exist. If it was the latest "
            "checkpoint a moment ago, a newer save_checkpoint(keep=...) rotated it away; call "
            "accel.latest_checkpoint(root) again."
        )
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        if not directory.is_dir():
            raise FileNotFoundError(
                f"{fn}: {str(directory)!r} was deleted while it was read: a newer save rotated "
                "it away. Call accel.latest_checkpoint(root) again."
            ) from None
        accelerate_hint = _accelerate_folder(fn, directory)
        if accelerate_hint:
            raise FileNotFoundError(accelerate_hint) from None
        raise FileNotFoundError(
            f"{fn}: {str(directory)!r} has no {MANIFEST}, so it is not a complete accel "
            "checkpoint (a save was interrupted, or it was written by something else). Use "
            "accel.latest_checkpoint(root) to find the newest complete one."
        ) from None
    try:
        manifest: Any = json.loads(text)
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise TypeError("no 'files' object")
        for rel, entry in manifest["files"].items():
            if not (
                isinstance(entry, list)
                and len(entry) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in entry)
            ):
                raise TypeError(f"the entry of {rel!r} is {entry!r}, not [size, crc32]")
    except (ValueError, TypeError, RecursionError) as err:  # RecursionError: nested too deep
        raise ValueError(
            f"{fn}: {str(path)!r} is not a valid accel manifest ({err}); the checkpoint is "
            "damaged. Load an earlier checkpoint."
        ) from None
    return manifest


def expected(manifest: dict[str, Any], rel: str) -> tuple[int, int] | None:
    """(size, crc32) the manifest recorded for `rel`, or None when it lists no such file."""
    entry = manifest["files"].get(rel)
    return None if entry is None else (int(entry[0]), int(entry[1]))


def check_sum(
    fn: str, path: Path, expect: tuple[int, int], size: int, crc: int | None = None
) -> None:
    """Refuse `path` when its `size`, or its `crc` once computed, differs from `expect`, the
    (size, crc32) its manifest recorded (`expected`).

    For a reader that checksums the bytes as it reads them: it checks the size before it
    reads (`crc=None`) and the checksum after.

    Raises:
        CorruptFileError: naming the file, what was found and what the manifest recorded.
    """
    if size == expect[0] and (crc is None or crc == expect[1]):
        return
    found = f"size {size}" if crc is None else f"size {size}, crc32 {crc:#010x}"
    raise CorruptFileError(
        f"{fn}: {str(path)!r} fails its checksum ({found}; the manifest recorded size "
        f"{expect[0]}, crc32 {expect[1]:#010x}); the file is corrupt, truncated or was "
        "replaced. Load an earlier checkpoint."
    )


def check_file(fn: str, path: Path, manifest: dict[str, Any], rel: str) -> None:
    """Refuse `path` unless its size and crc32 equal the entry of `rel` (its path relative to
    the manifest's folder) in `manifest` (`read_manifest`).

    Reads the file once (memory-mapped, checksummed on several threads), after a size check
    that reads nothing. A caller that reads the bytes anyway checksums them itself and calls
    `check_sum`.

    Raises:
        CorruptFileError: the manifest lists no `rel`, or the file differs from its entry.
        FileNotFoundError: the file does not exist.
    """
    expect = expected(manifest, rel)
    if expect is None:
        raise CorruptFileError(
            f"{fn}: {str(path)!r} is not listed in its folder's {MANIFEST} ({rel!r}), so it "
            "cannot be verified; the folder was changed after it was saved. Load an earlier "
            "checkpoint."
        )
    check_sum(fn, path, expect, path.stat().st_size)
    check_sum(fn, path, expect, *checksum_file(path))
