"""The exit guard that keeps gloo's worker threads from aborting a finished process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from accel._exit import drain_gloo_workers, runnable_threads


def _task(tasks: Path, tid: int, comm: str, state: str) -> None:
    (tasks / str(tid)).mkdir()
    (tasks / str(tid) / "stat").write_text(f"{tid} ({comm}) {state} 1 {tid} {tid} 0 -1 4194624\n")


def test_runnable_threads_counts_only_running_threads_of_that_name(tmp_path: Path) -> None:
    _task(tmp_path, 10, "python", "R")
    _task(tmp_path, 11, "pt_gloo_runloop", "R")
    _task(tmp_path, 12, "pt_gloo_runloop", "S")
    _task(tmp_path, 13, "pt_gloo_runloop", "R")
    _task(tmp_path, 14, "odd (name) R", "S")  # a comm holding parentheses and a state letter
    assert runnable_threads("pt_gloo_runloop", tmp_path) == 2
    assert runnable_threads("python", tmp_path) == 1
    assert runnable_threads("odd (name) R", tmp_path) == 0


def test_runnable_threads_reads_this_process() -> None:
    # The calling thread is running while it reads its own state.
    assert runnable_threads(Path("/proc/self/comm").read_text().strip()) >= 1


@pytest.mark.timeout(60)
def test_drain_returns_on_quiet_polls_without_gloo_threads() -> None:
    # No gloo worker is runnable here, so it must stop after its quiet polls, long before the
    # 10-minute deadline: a drain that waited for its deadline fails at the test's timeout.
    drain_gloo_workers(timeout=600.0)


# Issue 29 item 10: a DDP module holds its gloo group after `shutdown` destroyed it; freeing the
# module then runs the group's destructor, which joins gloo's worker threads while holding the
# GIL, and a worker still releasing the last collective's tensors waits for the GIL: the process
# never exits. Without the fix this loop hung within a few hundred rounds (at rounds 12 and 282
# in two tries); each round frees the module right after the last collective, after `shutdown`
# or before it.
FREE_AFTER_COLLECTIVE = """
import sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
import accel

store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
for i in range(int(sys.argv[1])):
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"round-{i}/", store), rank=0, world_size=1
    )
    ctx = accel.RunContext(backend="gloo")
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    model(torch.randn(2, 4)).sum().backward()
    gathered = [torch.empty(64)]
    for _ in range(3):
        dist.all_gather(gathered, torch.randn(64) * 2)  # a temporary: the worker frees it last
    if i % 2:
        del model
    accel.shutdown(ctx)
    model = None
print("exited every round", flush=True)
"""


@pytest.mark.slow
def test_freeing_a_ddp_module_after_shutdown_never_deadlocks(tmp_path: Path) -> None:
    script = tmp_path / "rounds.py"
    script.write_text(FREE_AFTER_COLLECTIVE)
    try:
        out = subprocess.run(
            [sys.executable, str(script), "300"], capture_output=True, text=True, timeout=150
        )
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"deadlocked: {(err.stdout or b'')[-300:]!r}") from None
    assert out.returncode == 0 and "exited every round" in out.stdout, out.stderr[-2000:]
