"""Scripts launched at 2 processes exit promptly, whatever order their objects are freed in.

Issue 29 item 10: a script that trains a DDP model (`wrap_model`), evaluates with
`gather_for_metrics`, calls `accel.shutdown(ctx)` and returns hung at exit in about one run in
three: the DDP model freed at the return destroyed the gloo group, whose destructor joined a
worker thread waiting for the GIL the main thread held. The hang happens at process exit, so each
try is a real `accel launch` of two real processes; several run at once to keep the test short.
"""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.cli.test_cli import _env

SHAPE = """
import gc, sys
import torch
from torch.utils.data import DataLoader, TensorDataset
import accel


def main(order):
    ctx = accel.init_distributed()
    torch.manual_seed(0)
    model = accel.wrap_model(ctx, torch.nn.Linear(8, 2))  # DDP at 2 processes
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    train = accel.shard_loader(ctx, DataLoader(data, batch_size=8, shuffle=True))
    for x, y in train:
        accel.scaled_backward(ctx, torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    evaluation = accel.shard_loader(ctx, DataLoader(data, batch_size=8))
    correct = 0
    with torch.no_grad():
        for x, y in evaluation:
            predicted, labels = accel.gather_for_metrics(
                ctx, (model(x).argmax(-1), y), loader=evaluation
            )
            correct += int((predicted == labels).sum())
    print(f"rank {ctx.rank} evaluated {correct}", flush=True)
    if order == "free_then_shutdown":
        del model, optimizer
        gc.collect()
    if order != "no_shutdown":
        accel.shutdown(ctx)
    # "shutdown_then_return": the model is freed here, after shutdown


main(sys.argv[1])
"""

ORDERS = ("shutdown_then_return", "free_then_shutdown", "no_shutdown")
LAUNCHES = 12  # the hang struck one run in three: 12 runs miss it with odds (2/3)**12 < 1%
AT_ONCE = 4
TIMEOUT_S = 240  # far above a launch on a loaded machine; a hang never ends


def _launch(script: Path, tmp_path: Path, order: str) -> str:
    try:
        out = subprocess.run(
            [sys.executable, "-m", "accel", "launch", "--num_processes", "2", str(script), order],
            env=_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"{order}: hung (no exit after {TIMEOUT_S} s)"
    done = out.stdout.count("evaluated")
    if out.returncode != 0 or done != 2:
        return f"{order}: exit code {out.returncode}, {done} ranks done: {out.stderr[-1500:]}"
    return "ok"


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 12 real launches of 2 processes: about a minute on 2 loaded cores
def test_twelve_launches_of_a_ddp_script_all_exit(tmp_path: Path) -> None:
    script = tmp_path / "shape.py"
    script.write_text(SHAPE)
    orders = [ORDERS[i % len(ORDERS)] for i in range(LAUNCHES)]
    with ThreadPoolExecutor(AT_ONCE) as pool:
        results = list(pool.map(lambda order: _launch(script, tmp_path, order), orders))
    failures = [r for r in results if r != "ok"]
    assert not failures, f"{len(failures)} of {LAUNCHES} launches failed: {failures[:3]}"


ABORT = """
import os
import accel


def abort_on_rank_1(ctx):
    if ctx.rank == 1:
        os.abort()  # as a C++ std::terminate ends a worker: SIGABRT, no Python exception


ctx = accel.init_distributed()
abort_on_rank_1(ctx)
accel.shutdown(ctx)
"""


def _launch_twice(script: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`accel launch --num_processes 2 script`, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "accel", "launch", "--num_processes", "2", str(script)],
        env=_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path,
    )  # fmt: skip


@pytest.mark.slow
def test_a_worker_that_aborts_prints_its_python_stack(tmp_path: Path) -> None:
    script = tmp_path / "aborts.py"
    script.write_text(ABORT)
    out = _launch_twice(script, tmp_path)
    assert out.returncode == 1, out.stderr
    assert "1 (killed by SIGABRT)" in out.stderr, out.stderr
    assert "Fatal Python error: Aborted" in out.stderr, out.stderr
    # Every frame down to the call that aborted, in faulthandler's format.
    frames = re.findall(r'File "(.*aborts\.py)", line (\d+) in (\S+)', out.stderr)
    assert [(line, name) for _, line, name in frames] == [
        ("8", "abort_on_rank_1"),
        ("12", "<module>"),
    ], out.stderr


# Issue 41 item 2, caught by faulthandler in a fresh-clone CI run: transformers' Trainer under
# `accel launch` (tests/cli/test_trainer_launch.py) died at exit with "terminate called without
# an active exception" on rank 1. Its gloo group is Accelerate's, made without accel, so the exit
# guard accel registers with its own group never ran. This script makes the abort certain rather
# than a few runs in a hundred: the last collective's tensor is freed by gloo's worker thread
# (nobody waits on it), whose storage belongs to a Python object (a numpy array), while the main
# thread keeps the GIL (a 1000 s switch interval) until finalization has begun.
PLAIN_TORCH = """
import sys, time
import numpy as np
import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # from torchrun's variables, as Accelerate's state does
sys.setswitchinterval(1000.0)
dist.all_reduce(torch.from_numpy(np.ones(4)), async_op=True)  # gloo's thread frees it
end = time.perf_counter() + 0.2
while time.perf_counter() < end:  # the GIL held while the collective ends and its thread waits
    pass
sys.stdout.write("finished\\n")  # flushed during finalization, which releases the GIL
"""


@pytest.mark.slow
def test_a_script_with_its_own_gloo_group_exits_cleanly(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_TORCH)
    out = _launch_twice(script, tmp_path)
    assert out.returncode == 0 and out.stdout.count("finished") == 2, out.stderr[-2000:]
