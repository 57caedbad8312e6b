"""How a worker process ends: cleanly with gloo groups alive, and together with its launcher.

Each gloo worker thread drops its reference to a finished collective just after waking the
caller. If that frees a tensor whose Python object the tensor owns, the thread must take the
GIL; once the interpreter has begun finalizing, CPython ends such a thread with pthread_exit,
which unwinds through a noexcept frame, and the whole process aborts ("terminate called without
an active exception", SIGABRT) after the script has done all its work. It happens when the last
collective is followed quickly by the end of the script, a few runs in a hundred on a busy
machine (https://github.com/pytorch/pytorch/issues/190489). Destroying the group joins the
threads, but a DistributedDataParallel module keeps the group alive until finalization even
after `destroy_process_group()`, so the threads can outlive it.

The guard registered here runs at exit, while the interpreter is still whole (after
`init_distributed`'s own exit hook has destroyed the group it created): it lets gloo's worker
threads finish whatever they were releasing before finalization begins. It waits only while
one of them is runnable: a few milliseconds in practice.

The same wait comes before a group is destroyed (`accel.shutdown`, that exit hook): the
group's destructor joins the worker threads while holding the GIL, there or later when a DDP
module holding the group is freed, and a thread still releasing a tensor waits for the GIL,
so the process would never exit.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import signal
import sys
import time
from pathlib import Path

_TASKS = Path("/proc/self/task")
_GLOO_WORKER = "pt_gloo_runloop"  # the thread name ProcessGroupGloo gives its workers
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def runnable_threads(name: str, tasks: Path = _TASKS) -> int:
    """How many of this process's threads called `name` are running or waiting for a CPU."""
    count = 0
    for stat_file in tasks.glob("*/stat"):
        try:
            stat = stat_file.read_text()
        except OSError:  # the thread ended while we looked
            continue
        # "<tid> (<comm>) <state> ...": comm may hold spaces or parentheses.
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        state = stat[stat.rindex(")") + 2]
        count += comm == name and state == "R"
    return count


def drain_gloo_workers(timeout: float = 0.5, quiet_polls: int = 3) -> None:
    """Sleep (releasing the GIL) until no gloo worker thread has been runnable for a few polls."""
    if not _TASKS.is_dir():  # not Linux: no thread states to read; give the workers a moment
        time.sleep(0.02)
        return
    deadline = time.monotonic() + timeout
    quiet = 0
    while quiet < quiet_polls and time.monotonic() < deadline:
        time.sleep(0.002)
        quiet = 0 if runnable_threads(_GLOO_WORKER) else quiet + 1


@functools.cache
def register_exit_guard() -> None:
    """Have `drain_gloo_workers` run at exit; registered once per process however often called."""
    atexit.register(drain_gloo_workers)


def die_with_parent() -> None:
    """Have Linux SIGKILL this process when its parent (torchrun's agent) dies.

    torchrun starts each worker in a session of its own, so killing the launcher, even its whole
    process group with `kill -9`, leaves the workers running: they go on training and writing
    checkpoints, next to a resumed run, until a collective fails. A no-op off Linux.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # refused (e.g. by a seccomp policy): keep torchrun's behaviour
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)
