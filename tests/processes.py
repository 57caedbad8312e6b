"""Helpers for tests that check processes are gone (killed launchers, ranks, workers)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any


def alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (killed, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def descendants(pid: int) -> list[int]:
    """The pids of every living process below `pid` (children, their children, ...)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):  # ended while we looked
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [c for c, p in parents.items() if p in frontier]
        found += children
        frontier = children
    return [p for p in found if alive(p)]


# Helper processes that outlive a test by design: run_world's forkserver (one per pytest
# process, kept for every later world), multiprocessing's resource tracker, and the session's
# SLURM daemons (tests/slurm_cluster.py; slurmctld forks slurmscriptd) and the session's GCS
# emulator (tests/gcs_server.py); the jobs' processes below them still count.
_SESSION_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker",
                    "munged\0", "slurmctld\0", "slurmscriptd", "slurmd\0",
                    "gcp_storage_emulator\0")  # fmt: skip


def leftovers(pid: int) -> list[int]:
    """The living processes below `pid` that a test left behind: its descendants, less the
    session's multiprocessing helpers (a test that ran after a run_world sees those)."""
    found = []
    for child in descendants(pid):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError):  # ended while we looked
            continue
        if not any(helper in command for helper in _SESSION_HELPERS):
            found.append(child)
    return found


def kill_while_busy(target: Callable[..., None], args: tuple[Any, ...], delay: float) -> None:
    """Fork `target(*args, ready)`; once it sets `ready`, let it run `delay` seconds, then
    SIGKILL and reap it. Forked, as torch is imported already: each child starts at once."""
    fork = mp.get_context("fork")
    ready = fork.Event()
    child = fork.Process(target=target, args=(*args, ready))
    with warnings.catch_warnings():
        # Python >= 3.12 warns about forking a process with threads (torch's pool, a store
        # client's event loop); the children here touch neither before making their own.
        warnings.simplefilter("ignore", DeprecationWarning)
        child.start()
    assert ready.wait(timeout=60)
    time.sleep(delay)
    assert child.pid is not None
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert child.exitcode == -signal.SIGKILL
