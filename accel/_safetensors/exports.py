"""Publishing a model export (`save_model`, `merge-weights`) so that a kill at any instant leaves
a folder that loads as the complete previous export or the complete new one.

The Hugging Face names are fixed, so the new files cannot all appear in one rename. Instead:

1. the writer holds an exclusive `flock` on the folder for the whole save (`export_lock`);
2. it writes every new file under its hidden partial name (`.model.safetensors.partial`);
3. it writes the journal (`.accel-export.json`: the new manifest and the earlier export's
   files the new one replaces) atomically: from that instant the new export is decided;
4. it completes the journal (`complete`): renames each partial into place, removes the
   replaced files, writes the manifest, removes the journal.

Before step 3 the folder holds the previous export untouched (loaders ignore hidden names).
After it, every accel loader completes the journal before reading (`settle`, called by
`resolve_checkpoint`), under the same lock: a live writer holds it for the few renames left, a
killed one released it when it died. The next save does the same, and either removes the
partial files a killed writer left. Only names accel's exports write are ever removed.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from accel._safetensors.manifests import MANIFEST

logger = logging.getLogger(__name__)

JOURNAL = ".accel-export.json"
# The files an export writes (and so may replace when it writes another layout); nothing else.
OWN_FILES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
_PARTIAL = re.compile(
    r"\.(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|"
    + re.escape(MANIFEST)
    + r"|"
    + re.escape(JOURNAL)
    + r")\.partial"
)


def partial_path(path: Path) -> Path:
    """The hidden name a file is written under before it is renamed into place."""
    return path.with_name(f".{path.name}.partial")


def fsync_path(path: Path) -> None:
    """Make a written file's data, or a directory's entries (created, renamed files), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _lock(directory: Path, *, wait: bool) -> int | None:
    """An fd of `directory` holding its exclusive flock; None when another process holds it
    (and not `wait`) or the filesystem has no flock (then nothing can tell a live writer)."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN) and not wait:
            return None
        if err.errno in (errno.ENOLCK, errno.EBADF, errno.EINVAL, errno.EOPNOTSUPP):
            logger.debug("no flock on %s (%s): exports there are not guarded", directory, err)
            return None
        raise
    return fd


def _unlock(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # closing the last fd of the open file releases the flock


@contextmanager
def export_lock(directory: Path) -> Iterator[None]:
    """Hold the folder's export lock while a save writes into it; first finish (or clean up
    after) a save of the folder that was killed. The folder must exist."""
    fd = _lock(directory, wait=True)
    try:
        recover(directory, locked=True)
        yield
    finally:
        _unlock(fd)


def write_journal(directory: Path, manifest: dict[str, Any], stale: list[str]) -> None:
    """Decide the new export: its manifest and the files it replaces, written atomically."""
    hidden = partial_path(directory / JOURNAL)
    data = json.dumps({"manifest": manifest, "stale": stale}, indent=1).encode()
    with open(hidden, "wb") as f:
        f.write(data)
        os.fsync(f.fileno())
    hidden.replace(directory / JOURNAL)  # the last step that can fail before it is decided


def complete(directory: Path) -> None:
    """Finish the export the journal decided: rename, remove replaced files, manifest, journal.

    Every step can be repeated, so a writer killed during it is finished by the next one.
    """
    journal = directory / JOURNAL
    try:
        doc = json.loads(journal.read_bytes())
        manifest, stale = doc["manifest"], [str(n) for n in doc["stale"]]
        names = [str(n) for n in manifest["files"]]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise ValueError(
            f"{str(journal)!r} is not the journal of an accel export (damaged); remove it and "
            "save the model again."
        ) from None
    fsync_path(directory)  # the journal is durable before any file is renamed
    for name in names:  # each rename atomic: the new files replace the old ones
        with suppress(FileNotFoundError):  # renamed already (by the writer, before it died)
            partial_path(directory / name).replace(directory / name)
    for name in stale:  # the earlier export's files of another layout (an index first)
        if OWN_FILES.fullmatch(name) and name not in names:
            (directory / name).unlink(missing_ok=True)
    hidden = partial_path(directory / MANIFEST)
    with open(hidden, "wb") as f:
        f.write(json.dumps(manifest, indent=1).encode())
        os.fsync(f.fileno())
    hidden.replace(directory / MANIFEST)
    fsync_path(directory)
    journal.unlink(missing_ok=True)
    fsync_path(directory)


def recover(directory: Path, *, locked: bool) -> None:
    """Finish an export that a killed writer decided, and remove the partial files of one it
    had not; `locked`: the caller holds the export lock."""
    if (directory / JOURNAL).exists():
        complete(directory)
    if not locked:
        return
    for path in directory.iterdir():
        if _PARTIAL.fullmatch(path.name):
            logger.debug("removing %s, left by an interrupted export", path)
            path.unlink(missing_ok=True)


def settle(fn: str, directory: Path) -> None:
    """Before a load: finish an export of `directory` a killed writer left half renamed, and
    remove its partial files when no writer is live. Writes nothing when there is nothing left."""
    try:
        names = os.listdir(directory)
    except OSError:
        return  # not a readable folder: the caller's own checks report it
    journal = JOURNAL in names
    if not journal and not any(_PARTIAL.fullmatch(n) for n in names):
        return
    try:
        fd = _lock(directory, wait=journal)  # a live writer holds it only for the renames
        try:
            if fd is not None or journal:
                recover(directory, locked=fd is not None)
        finally:
            _unlock(fd)
    except OSError as err:
        if not (directory / JOURNAL).exists():
            logger.debug("could not remove partial files in %s: %s", directory, err)
            return
        raise OSError(
            err.errno,
            f"{fn}: {str(directory)!r} holds a model export whose save was interrupted while "
            f"its files were renamed, and it cannot be finished here ({err.strerror}); load it "
            "where the folder is writable once, or save the model again.",
        ) from None
