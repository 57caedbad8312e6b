"""The exit guard that keeps gloo's worker threads from aborting a finished process."""

from __future__ import annotations

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
