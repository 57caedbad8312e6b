"""run_world ranks can start DataLoader workers and are killed with them at the hard timeout."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from accel import RunContext, gather
from accel.testing import run_world
from tests.processes import alive

pytestmark = pytest.mark.dist


class _Pids(IterableDataset[int]):
    """Yields the pid of the worker that reads it, then (optionally) blocks forever."""

    def __init__(self, folder: str, hang: bool) -> None:
        self.folder, self.hang = folder, hang

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        assert info is not None  # read by a worker, never in the rank itself
        Path(self.folder, f"worker-{os.getpid()}").write_text(str(os.getppid()))
        yield os.getpid()
        while self.hang:
            time.sleep(0.1)


def _read_with_workers(ctx: RunContext, folder: str, hang: bool) -> list[int]:
    pids = [int(p) for p in DataLoader(_Pids(folder, hang), batch_size=None, num_workers=2)]
    return gather(ctx, torch.tensor(pids)).tolist()


def test_ranks_can_start_dataloader_workers(tmp_path: Path) -> None:
    results = run_world(_read_with_workers, world_size=2, timeout=60, args=(str(tmp_path), False))
    workers = {int(p.name.split("-")[1]) for p in tmp_path.glob("worker-*")}
    assert len(workers) == 4  # 2 ranks x 2 workers, all different processes
    assert results[0] == results[1]
    assert set(results[0]) == workers


def _workers(folder: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in folder.glob("worker-*")]


def test_timeout_kills_ranks_and_their_workers(tmp_path: Path) -> None:
    # run_world's deadline runs from the spawn, and under load starting torch in a rank can take
    # longer than it: a world killed before its 4 workers wrote their markers proves nothing
    # about workers. So the world is run again, with three times the time, until the timeout
    # fired after all 4 had started; the workers of every try must be gone.
    for timeout in (15, 45, 135):
        folder = tmp_path / f"timeout-{timeout}"
        folder.mkdir()
        with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] were still running"):
            run_world(_read_with_workers, world_size=2, timeout=timeout, args=(str(folder), True))
        workers = _workers(folder)
        deadline = time.monotonic() + 5
        while any(alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in workers if alive(p)], "DataLoader workers outlived their killed rank"
        if len(workers) == 4:
            break
    assert len(workers) == 4, f"the workers had not all started after a timeout of {timeout} s"


def _start_method(ctx: RunContext) -> str:
    import multiprocessing

    return multiprocessing.get_start_method()


def test_ranks_start_workers_with_the_platform_default_method() -> None:
    import multiprocessing

    # as under torchrun: not "spawn" inherited from run_world (seconds per worker)
    default = multiprocessing.get_all_start_methods()[0]
    assert run_world(_start_method, world_size=1, timeout=60) == [default]


def _leave_a_child(ctx: RunContext, crash: bool) -> int:
    import subprocess

    child = subprocess.Popen(["sleep", "120"])  # in the rank's process group, never waited for
    if crash and ctx.rank == 1:
        raise RuntimeError(f"rank 1 crashed, leaving pid {child.pid}")
    return child.pid


def _gone_soon(pid: int) -> bool:
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


@pytest.mark.parametrize("crash", [False, True], ids=["ranks-return", "a-rank-crashes"])
def test_children_a_rank_leaves_behind_are_killed(crash: bool) -> None:
    if crash:
        with pytest.raises(RuntimeError, match=r"rank 1 crashed, leaving pid") as info:
            run_world(_leave_a_child, world_size=2, timeout=60, args=(True,))
        pids = [int(str(info.value).rsplit(" ", 1)[1])]
    else:
        pids = run_world(_leave_a_child, world_size=2, timeout=60, args=(False,))
    assert all(_gone_soon(p) for p in pids), "a child of a finished rank outlived run_world"


def _abort_on_rank_1(ctx: RunContext) -> None:
    if ctx.rank == 1:
        os.abort()  # as a C++ std::terminate ends a process: SIGABRT, no Python exception


def _nothing(ctx: RunContext) -> None:
    pass


def test_a_rank_that_aborts_prints_its_python_stack(tmp_path: Path) -> None:
    # The ranks print where the caller's stderr is now, not where it was when the forkserver
    # started (under pytest: an earlier test's capture, where the stack was lost): start the
    # server first, then point stderr elsewhere, as the next test's capture does.
    run_world(_nothing, world_size=1, timeout=60)
    log = tmp_path / "stderr"
    saved = os.dup(2)
    try:
        with log.open("w") as file:
            os.dup2(file.fileno(), 2)
            with pytest.raises(RuntimeError, match="rank 1 was killed by signal 6"):
                run_world(_abort_on_rank_1, world_size=2, timeout=60)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    err = log.read_text()
    assert "Fatal Python error: Aborted" in err, err
    # The frame that aborted, by file and name (faulthandler's format).
    assert re.search(r'File ".*test_run_world_workers.py", line \d+ in _abort_on_rank_1', err), err
