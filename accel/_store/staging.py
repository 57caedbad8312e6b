"""Local folders that a transfer to or from a store passes through.

A save to a store is written here first (each rank its own files, not fsynced: the store's copy
is the durable one) and a load downloads here, in the machine's temporary folder (`TMPDIR`).
Each folder is removed when its transfer ends; one whose process was killed is removed by the
next transfer on the machine (its name holds the host and process id). Only names this module
gives are ever removed.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

_NAME = re.compile(r"accel-(?:upload|download)-(?P<host>[\w-]*)-(?P<pid>\d+)-[0-9a-f]{8}")


def host_name() -> str:
    """This machine's name as accel writes it into the names of its temporary files."""
    return re.sub(r"[^\w-]", "_", socket.gethostname())


def writer_gone(host: str, pid: int) -> bool:
    """True when the process `pid` of machine `host` that named a temporary file is known to
    be gone (on another machine it may be alive: never)."""
    if host != host_name():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def sweep(parent: Path) -> None:
    """Remove the transfer folders in `parent` whose process on this machine has died."""
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for path in entries:
        match = _NAME.fullmatch(path.name)
        if match and writer_gone(match["host"], int(match["pid"])):
            logger.debug("removing %s, left by a killed transfer", path)
            shutil.rmtree(path, ignore_errors=True)


def new_folder(kind: str) -> Path:
    """A new, empty folder for one transfer (`kind`: "upload" or "download")."""
    parent = Path(tempfile.gettempdir())
    sweep(parent)
    path = parent / f"accel-{kind}-{host_name()}-{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir()
    return path


def remove(path: Path) -> None:
    """Remove a transfer folder (tolerating parts of it gone already)."""
    shutil.rmtree(path, ignore_errors=True)


@contextmanager
def transfer_folder(kind: str) -> Iterator[Path]:
    """A new transfer folder for the block, removed after it."""
    path = new_folder(kind)
    try:
        yield path
    finally:
        remove(path)


@contextmanager
def named_as(folder: Path, url: str) -> Iterator[None]:
    """Re-raise an error whose message names the local `folder` (a download of `url`) naming
    `url` instead: the user passed the URL, and the folder is gone once the call returns."""
    try:
        yield
    except (OSError, ValueError, TypeError, RuntimeError) as err:
        text = str(err) if not isinstance(err, OSError) or not err.strerror else err.strerror
        if str(folder) not in text:
            raise
        text = text.replace(str(folder), url)
        if isinstance(err, OSError) and err.errno:
            raise OSError(err.errno, text) from err
        raise type(err)(text) from err
