"""Numbered checkpoints `root/step-<n>`: which are complete, and rotating old ones away."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from accel._safetensors import manifests
from accel.checkpoint import _atomic

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"step-(\d+)")


def complete_steps(root: Path) -> list[tuple[int, Path]]:
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(
            f"latest_checkpoint: root={str(root)!r} is a file, not a folder of step-<n> "
            "checkpoints. Pass the folder given to save_checkpoint."
        )
    # A writer with keep= may publish step n+1 and rotate step n away between the listing and
    # the checks: when every listed checkpoint vanished that way, list again.
    for _ in range(100):
        found, vanished = [], False
        for path in root.iterdir() if root.is_dir() else ():
            match = _STEP_DIR.fullmatch(path.name)
            if match and _is_complete(path):
                found.append((int(match[1]), path))
            vanished = vanished or (match is not None and not path.exists())
        if found or not vanished:
            break
    return sorted(found)


def _is_complete(path: Path) -> bool:
    try:
        manifest = manifests.read_manifest("latest_checkpoint", path)
        for rel, (size, _) in manifest["files"].items():
            if (path / rel).stat().st_size != size:
                logger.debug("skipping %s: %s has not the size its manifest records", path, rel)
                return False
    except (OSError, ValueError) as err:  # incomplete, damaged, or rotated away meanwhile
        logger.debug("skipping %s: %s", path, err)
        return False
    return True


def rotate(root: Path, keep: int, step: int) -> None:
    for old_step, path in complete_steps(root)[:-keep]:
        if old_step == step:
            continue
        # Renamed first, so a kill during the deletion leaves a name the next save removes.
        doomed = _atomic.sibling(path, "deleting")
        try:
            path.rename(doomed)
        except FileNotFoundError:
            continue  # another writer rotated it away already
        _atomic.remove_tree(doomed)
