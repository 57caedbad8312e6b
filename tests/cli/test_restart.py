"""`accel launch --max_restarts 1`: a rank dies once, the agent restarts the workers, and the
script resumes from its latest checkpoint to the parameters of an uninterrupted run; on one
machine, and on two machines (two launchers on the loopback, c10d rendezvous, issue 36)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.test_cli import _env, _free_port, accel_cli
from tests.processes import leftovers

SCRIPT = """
import json, os, sys, time
from pathlib import Path
import torch
import accel

# how rank 1 ends at step `die_at` of the first attempt: "exit" crashes, "wait" waits for the
# test's SIGKILL (and rank 0 for its agent, out of any collective)
out, die_at, how = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ctx = accel.init_distributed(seed=0)
accel.set_seed(0, ctx=ctx)
model = accel.wrap_model(ctx, torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
state = {"model": model, "optimizer": optimizer}
step = 0
if (latest := accel.latest_checkpoint(out / "ckpt")) is not None:
    accel.load_state(ctx, latest, **state)
    step = int(latest.name.split("-")[1])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
with (out / f"attempts-{ctx.rank}.txt").open("a") as attempts:
    attempts.write(f"{attempt} {os.environ['GROUP_RANK']}\\n")
while step < 6:
    x = torch.randn(8, 4)  # the per-rank RNG stream is restored from the checkpoint
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    accel.scaled_backward(ctx, loss)
    accel.optimizer_step(ctx, optimizer)
    optimizer.zero_grad()
    step += 1
    accel.save_checkpoint(ctx, out / "ckpt", state, step=step, keep=1)
    if step == die_at and not (out / "died").exists():
        if how == "exit" and ctx.rank == 1:
            (out / "died").touch()
            os._exit(3)  # a crash: no clean-up, no exception
        if how == "wait":
            if ctx.rank == 1:
                (out / "victim.tmp").write_text(str(os.getpid()))
                (out / "victim.tmp").rename(out / "victim.pid")  # whole, when the test sees it
            time.sleep(120)
if ctx.is_main:
    params = [p.tolist() for p in accel.unwrap_model(model).parameters()]
    (out / "result.json").write_text(json.dumps({"attempt": attempt, "params": params}))
accel.shutdown(ctx)
"""


def _one_machine(tmp: Path, script: Path, out: Path, die_at: int, *flags: str) -> None:
    """`accel launch --num_processes 2 *flags` of SCRIPT into `out`, which must succeed."""
    out.mkdir()
    run = accel_cli(
        tmp, "launch", "--num_processes", "2", *flags, str(script), str(out), str(die_at), "exit"
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_a_rank_that_dies_once_is_restarted_and_resumes(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    results = {}
    for name, die_at in (("uninterrupted", 0), ("crashed", 3)):
        out = tmp_path / name
        _one_machine(
            tmp_path, script, out, die_at, "--max_restarts", "1", "--monitor_interval", "0.2"
        )
        results[name] = json.loads((out / "result.json").read_text())
    assert results["uninterrupted"]["attempt"] == 0
    assert results["crashed"]["attempt"] == 1  # the agent restarted the workers once
    assert results["crashed"]["params"] == results["uninterrupted"]["params"]


def test_without_restarts_the_crash_fails_the_launch(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run = accel_cli(
        tmp_path, "launch", "--num_processes", "2", str(script), str(tmp_path), "3", "exit"
    )
    assert run.returncode != 0


@contextlib.contextmanager
def _machines(
    tmp: Path, command: list[str], common: list[str]
) -> Iterator[list[subprocess.Popen[str]]]:
    """Two launchers as two machines on the loopback (`command` ends with the flag that takes
    the machine's rank); whatever is left of them is killed on the way out."""
    options = {"env": _env(tmp), "cwd": tmp, "text": True, "stdout": subprocess.PIPE}
    argv = [[sys.executable, "-m", *command, str(rank), *common] for rank in (0, 1)]
    launches = [subprocess.Popen(a, stderr=subprocess.PIPE, **options) for a in argv]
    try:
        yield launches
    finally:
        for launch in launches:
            launch.kill()
            launch.communicate()


def _two_machines(tmp: Path, script: Path, out: Path, kill_at: int) -> None:
    """Two `accel launch` processes as two machines on the loopback (c10d, one restart)."""
    port = _free_port()
    common = [
        "--num_machines", "2", "--num_processes", "2", "--rdzv_backend", "c10d",
        "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--max_restarts", "1",
        "--monitor_interval", "0.2", str(script), str(out), str(kill_at), "wait",
    ]  # fmt: skip
    with _machines(tmp, ["accel", "launch", "--machine_rank"], common) as launches:
        deadline = time.monotonic() + 180
        while kill_at and not (out / "victim.pid").exists():
            assert time.monotonic() < deadline, "rank 1 never reached the step to be killed at"
            assert all(launch.poll() is None for launch in launches), "a launch ended early"
            time.sleep(0.1)
        if kill_at:
            (out / "died").touch()  # the restarted workers must not wait again
            os.kill(int((out / "victim.pid").read_text()), signal.SIGKILL)
        logs = ["".join(launch.communicate(timeout=120)) for launch in launches]
    for launch, log in zip(launches, logs, strict=True):
        assert launch.returncode == 0, log


def _params(out: Path) -> list[object]:
    return list(json.loads((out / "result.json").read_text())["params"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_worker_killed_on_one_of_two_machines_restarts_both_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    # Machine 1's agent sees its worker fail and restarts it (TORCHELASTIC_RESTART_COUNT 1);
    # machine 0's worker is not in a collective, so its agent restarts it because a machine
    # is waiting at the rendezvous, which torchrun does not count as a restart (still 0).
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    params = {}
    for name, kill_at in (("uninterrupted", 0), ("killed", 3)):
        out = tmp_path / name
        out.mkdir()
        _two_machines(tmp_path, script, out, kill_at)
        params[name] = _params(out)
    one_machine = tmp_path / "one-machine"  # the same 2 ranks on one machine, uninterrupted
    _one_machine(tmp_path, script, one_machine, 0)
    attempts = [(tmp_path / "killed" / f"attempts-{r}.txt").read_text().split("\n") for r in (0, 1)]
    assert attempts == [["0 0", "0 0", ""], ["0 1", "1 1", ""]]
    assert params["killed"] == params["uninterrupted"]  # bit for bit
    assert params["uninterrupted"] == _params(one_machine)
    assert leftovers(os.getpid()) == []


@pytest.mark.slow
def test_plain_torchrun_on_two_machines_with_restarts_and_its_shared_store_warns(
    tmp_path: Path,
) -> None:
    # torchrun's default: its agent's store is shared with the workers for the whole job
    script = tmp_path / "hello.py"
    script.write_text("import accel\naccel.shutdown(accel.init_distributed())\n")
    port = _free_port()
    common = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "1", str(script),
    ]  # fmt: skip
    with _machines(tmp_path, ["torch.distributed.run", "--node-rank"], common) as launches:
        errs = [launch.communicate(timeout=120)[1] for launch in launches]
    assert [launch.returncode for launch in launches] == [0, 0], errs
    assert "UserWarning: init_distributed: torchrun restarts workers (--max-restarts 1) on 2 " \
        "machines with one store shared for the whole job" in errs[0]  # fmt: skip
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in errs[0]
    assert "init_distributed" not in errs[1]  # said once, by rank 0
