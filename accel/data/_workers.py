"""The DataLoader settings accel carries over to the loaders it builds, and a worker watchdog.

A DataLoader worker started by `forkserver` is a child of the forkserver process, not of the
rank: torch's own check (the worker's parent pid changed) never fires when the rank is killed,
and the workers hold the forkserver's "alive" pipe and the resource tracker's pipe open, so the
forkserver, the tracker and the workers all outlive a rank killed with SIGKILL, indefinitely.
`PR_SET_PDEATHSIG` does not help: it follows the parent (the forkserver). So every worker of a
loader accel builds whose parent is not the rank starts, before the user's `worker_init_fn`, a
thread that waits for the rank's own process to end (a pidfd on Linux) and ends the worker with
it; the forkserver and the tracker then see their pipes close and exit by themselves. (Workers
started by fork or spawn are the rank's children, which torch's own check covers.)
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

# How often the watchdog checks the rank where the platform has no pidfd (not Linux).
_POLL_S = 1.0


def worker_options(loader: DataLoader[Any], generator: torch.Generator) -> dict[str, Any]:
    """The worker settings of the user's `loader`, for a DataLoader accel builds in its place.

    Its workers, pinning, timeout, init function and start method carry over unchanged;
    `generator` seeds the workers (and any shuffling) instead of torch's global RNG, and each
    worker ends when the process that started it (the rank) ends, whatever the start method.
    """
    options: dict[str, Any] = dict(
        generator=generator,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
    )
    if loader.num_workers > 0:  # DataLoader refuses a prefetch_factor without workers
        options["prefetch_factor"] = loader.prefetch_factor
        options["worker_init_fn"] = EndWithRank(os.getpid(), loader.worker_init_fn)
    return options


class EndWithRank:
    """A `worker_init_fn` that ties the worker's life to the rank's, then runs the user's.

    Holds plain values only (a pid and the user's function), since it is pickled into workers.
    """

    def __init__(self, rank_pid: int, init: Callable[[int], None] | None) -> None:
        self.rank_pid, self.init = rank_pid, init

    def __call__(self, worker_id: int) -> None:
        # A child of the rank itself (fork, spawn) is ended by torch's own check on its parent.
        if os.getppid() != self.rank_pid:
            watchdog = threading.Thread(
                target=_exit_when_ended,
                args=(self.rank_pid,),
                name="accel-rank-watchdog",
                daemon=True,
            )
            watchdog.start()
        if self.init is not None:
            self.init(worker_id)


def _exit_when_ended(pid: int) -> None:
    """Block until process `pid` has ended, then end this process at once."""
    try:
        if hasattr(os, "pidfd_open"):  # Linux: woken by the kernel when `pid` ends, no polling
            select.select([os.pidfd_open(pid)], [], [])
        else:
            while True:
                os.kill(pid, 0)
                time.sleep(_POLL_S)
    except ProcessLookupError:  # it had ended already
        pass
    os._exit(1)  # a worker of a dead rank has no one to deliver to; nothing to clean up
