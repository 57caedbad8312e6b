"""Crash-safe directories: write into a hidden sibling, fsync, write a manifest, rename.

A checkpoint directory is complete exactly when it exists under its final name: it only gets
that name by an atomic `rename` after every file in it and the manifest were fsynced. A crash
at any moment leaves either the previous state or a hidden sibling unique to its writer
(`.<name>.<host>-<pid>-<random>.partial`), which readers ignore and the next save removes once
that writer is gone. A failed save removes its own sibling at once.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import secrets
import shutil
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch

from accel._groups import describe, reported
from accel._safetensors.exports import fsync_path
from accel._safetensors.manifests import FORMAT, MANIFEST, read_manifest
from accel._store.staging import host_name, writer_gone
from accel._version import __version__

logger = logging.getLogger(__name__)

# Names accel gives its own temporary siblings of a checkpoint `name`:
#   .<name>.<host>-<pid>-<random>.partial    a save being written (unique per writer)
#   .<name>.<host>-<pid>-<random>.old        a checkpoint being replaced by a newer save of it
#   .<name>.<host>-<pid>-<random>.deleting   a checkpoint rotation is deleting
# Writers never share one, so two processes saving the same name cannot mix files, and a
# leftover is removed by the next save once its writer is known to be gone.
_DEBRIS = re.compile(
    r"\.(?P<name>.+)\.(?P<host>[\w-]*)-(?P<pid>\d+)-[0-9a-f]{8}\.(?P<kind>partial|old|deleting)"
)


def _token() -> str:
    return f"{host_name()}-{os.getpid()}-{secrets.token_hex(4)}"


def sibling(final: Path, kind: str) -> Path:
    """A fresh, unique hidden sibling of `final` of the given kind (partial, old, deleting)."""
    return final.parent / f".{final.name}.{_token()}.{kind}"


def sweep(parent: Path) -> None:
    """Remove accel's leftovers in `parent`: rotations cut short, saves whose writer died.

    Only names accel itself creates are considered (see `_DEBRIS`); a leftover of a live writer,
    or of a writer on another machine, is left alone. Failures (a read-only folder) are logged.
    """
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for path in entries:
        match = _DEBRIS.fullmatch(path.name)
        if match is None:
            continue  # not a name accel writes: never touched
        if match["kind"] == "deleting" or writer_gone(match["host"], int(match["pid"])):
            logger.debug("removing %s, left by an interrupted save or rotation", path)
            remove_tree(path)


def remove_tree(path: Path) -> None:
    """Delete a directory tree; tolerate parts (or all of it) vanishing meanwhile."""

    def onerror(func: Any, failed: str, exc_info: Any) -> None:
        if not isinstance(exc_info[1], FileNotFoundError):
            logger.debug("could not remove %s: %r", failed, exc_info[1])

    shutil.rmtree(path, onerror=onerror)


def write_at(fd: int, data: memoryview, offset: int, path: Path) -> None:
    """Write all of `data` at `offset` of the open `fd` (of `path`, named in an error).

    The kernel may write fewer bytes than asked and say so (a disk filling up, a file-size
    limit, a signal), raising only if the next write cannot go on; taking the count for
    success would publish a file with a hole. So the rest is written until none is left.
    """
    done = 0
    while done < len(data):
        try:
            wrote = os.pwrite(fd, data[done:], offset + done)
        except OSError as err:
            raise OSError(err.errno, err.strerror, str(path)) from err
        if wrote == 0:  # no progress and no error: never loop forever
            raise OSError(errno.EIO, "the write made no progress", str(path))
        done += wrote


def write_bytes(path: Path, data: bytes, *, fsync: bool = True) -> tuple[int, int]:
    """Write (and by default fsync) a small file; return (size, crc32)."""
    with open(path, "wb") as f:
        f.write(data)
    if fsync:
        fsync_path(path)
    return len(data), zlib.crc32(data)


def as_folder(fn: str, name: str, value: object) -> Path:
    """`value` as a Path; a value that is not a path, or names a file, is refused by name."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"{fn}: {name}={value!r} must be a folder path (str or os.PathLike); pass where the "
            f"files go, e.g. {name}='checkpoints'."
        )
    path = Path(value)
    for parent in [path, *path.parents]:
        if parent.exists() and not parent.is_dir():
            raise NotADirectoryError(
                f"{fn}: {name}={str(path)!r} cannot be a folder: {str(parent)!r} is a file; "
                "accel will not replace it. Pass a folder path."
            )
    return path


def check_target(fn: str, final: Path) -> bool:
    """Refuse a save over anything but an accel checkpoint; True when `final` is one to replace.

    Raises before anything is written: NotADirectoryError when `final` (or a parent) is a file,
    FileExistsError when it is a folder holding files that are not an accel checkpoint.
    """
    for parent in [final, *final.parents]:
        if parent.exists() and not parent.is_dir():
            raise NotADirectoryError(
                f"{fn}: directory={str(final)!r} cannot be created: {str(parent)!r} is a file, "
                "not a folder; accel will not rename or replace it. Pass a folder path."
            )
    if not final.exists():
        return False
    found = sorted(p.relative_to(final).as_posix() for p in final.rglob("*") if p.is_file())
    if not found:
        return False
    listed: set[str] = set()
    # A damaged manifest vouches for nothing: then every file counts as the user's.
    with suppress(ValueError):
        if (final / MANIFEST).is_file():
            listed = {MANIFEST, *read_manifest(fn, final)["files"]}
    foreign = [rel for rel in found if rel not in listed]
    if not foreign:
        return True
    what = "is not an accel checkpoint" if not listed else "holds files its manifest does not list"
    raise FileExistsError(
        f"{fn}: directory={str(final)!r} {what}; saving would replace it and lose "
        f"{foreign[:5]}{f' and {len(foreign) - 5} more' if len(foreign) > 5 else ''}. Pass a "
        "new or empty folder, or move those files away first."
    )


def manifest_bytes(entries: dict[str, list[int]], info: dict[str, Any]) -> bytes:
    """The manifest of a checkpoint of the files `entries` (rel -> [size, crc32]) and `info`."""
    manifest = {
        "format": FORMAT,
        "accel_version": __version__,
        "torch_version": torch.__version__,
        **info,
        "files": dict(sorted(entries.items())),
    }
    return json.dumps(manifest, indent=1).encode()


def publish(
    fn: str,
    staging: Path,
    final: Path,
    entries: dict[str, list[int]],
    info: dict[str, Any],
    *,
    replace: bool,
) -> None:
    """Write the manifest, fsync, and rename `staging` to `final`.

    With `replace`, an existing accel checkpoint `final` is renamed aside first and deleted
    after. Without it the rename never replaces a published checkpoint (a directory holding
    files cannot be renamed over): a second writer of the same name gets FileExistsError.
    """
    write_bytes(staging / MANIFEST, manifest_bytes(entries, info))
    for sub in sorted({p.parent for p in staging.rglob("*")} | {staging}, reverse=True):
        fsync_path(sub)
    old = sibling(final, "old")
    if replace:
        # Not atomic for a directory saved twice under one name: between the two renames the
        # name is missing (never half-written). Numbered checkpoints saved once skip this.
        with suppress(FileNotFoundError):  # moved away meanwhile: nothing to replace
            final.rename(old)
    try:
        staging.rename(final)
    except OSError as err:
        if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        raise FileExistsError(
            errno.EEXIST,
            f"{fn}: {str(final)!r} was published by another writer while this save ran, so "
            "this save was discarded (the published checkpoint is whole). Give each writer "
            "its own step or directory.",
        ) from err
    fsync_path(final.parent)
    if old.exists():
        remove_tree(old)


def cleanup_failed(fn: str, staging: Path, final: Path, err: BaseException) -> BaseException:
    """Remove a failed save's staging folder; return the error to raise, naming `final`."""
    remove_tree(staging)
    return _named(fn, final, err)


def _named(fn: str, final: Path, err: BaseException) -> BaseException:
    if isinstance(err, OSError) and not isinstance(err, FileExistsError) and err.errno:
        return OSError(
            err.errno,
            f"{fn}: saving {str(final)!r} failed: {describe(err)[1]}. The partial save was "
            "removed; the previous checkpoints are intact. Free space or fix the folder's "
            "permissions, then save again.",
        )
    return err


def failed_marker(staging: Path, rank: int) -> Path:
    """Where a rank other than 0 leaves the error that stopped its part of a save."""
    return staging / f".rank{rank}.failed"


def wait_for_files(
    paths: list[Path], timeout_s: float, *, failed: list[Path] | None = None
) -> None:
    """Wait until every path exists (other ranks' markers on a shared filesystem).

    With `failed` (each rank's `failed_marker`, in the order of `paths`), a rank counts as
    finished once it left either; once every rank has finished, the first failure is raised
    (not before: a rank still writing into the staging folder would recreate it after rank 0
    removed it). A staging folder gone meanwhile (a rank that could not even leave its marker
    removes it) is raised at once. Either way rank 0 does not wait out the timeout for a rank
    that gave up.
    """
    ends = failed or paths
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while not all(p.exists() or end.exists() for p, end in zip(paths, ends, strict=True)):
        if failed and not failed[0].parent.is_dir():
            raise FileNotFoundError(
                errno.ENOENT,
                "another rank's save failed and removed the staging folder",
                str(failed[0].parent),
            )
        if time.monotonic() > deadline:
            missing = [str(p) for p in paths if not p.exists()]
            raise TimeoutError(
                f"save_state: ranks did not finish writing within {timeout_s:.0f}s ({missing}); "
                "a rank died or the ranks do not share the checkpoint filesystem."
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    for path in failed or []:
        if path.exists():
            report = json.loads(path.read_text())
            raise reported(f"rank {report['rank']}: {report['error']}", report["errno"])


@contextmanager
def reported_on_failure(fn: str, staging: Path, final: Path, rank: int) -> Iterator[None]:
    """For a rank other than 0: when the block raises, leave the error in its `failed_marker`
    for rank 0, which stops waiting, removes `staging` and raises it too; when even the marker
    cannot be written, remove `staging`, which rank 0 notices as well. Re-raise, naming `final`.
    """
    try:
        yield
    except BaseException as err:
        code, text = describe(err)
        report = {"rank": rank, "errno": code, "error": text}
        marker = failed_marker(staging, rank)
        try:  # renamed into place, so rank 0 never reads half of it
            write_bytes(marker.with_suffix(".tmp"), json.dumps(report).encode(), fsync=False)
            marker.with_suffix(".tmp").rename(marker)
        except OSError:
            remove_tree(staging)
        new = _named(fn, final, err)
        if new is err:
            raise
        raise new from err


@contextmanager
def removed_on_failure(fn: str, staging: Path, final: Path) -> Iterator[None]:
    """Remove `staging` when the block raises; re-raise, naming `final` for OS errors."""
    try:
        yield
    except BaseException as err:
        new = cleanup_failed(fn, staging, final, err)
        if new is err:
            raise
        raise new from err
