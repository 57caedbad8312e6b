"""Pre-emption on a real SLURM cluster (tests/slurm_cluster.py: munged, slurmctld and slurmd on
127.0.0.1, one set for the session): every way SLURM stops a job ends with the job requeued and
then COMPLETED once, as SLURM records it, bit for bit equal to the same job uninterrupted.

- the shipped examples/slurm.sbatch (one `accel launch` per node through srun), stopped by
  `scancel --signal=USR1`;
- `srun -n 2 python train.py` (no launcher), stopped by SLURM's own `--signal=USR1@60`
  near its time limit;
- an administrator's `scontrol requeue` of a running job (SLURM sends SIGTERM);
- the same `srun -n 2` job uninterrupted: COMPLETED, never requeued, the reference.

The jobs run at the same time (the cluster has 8 slots) so their start-up overlaps.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from tests.dist.test_cluster_envs_dist import _ports
from tests.dist.test_preemption_dist import SCRIPT, STEPS
from tests.processes import leftovers
from tests.slurm_cluster import Cluster

REPO = Path(__file__).resolve().parents[2]
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
pytestmark = pytest.mark.timeout(600)

# `srun -n 2` of the pre-emption test's script; its first run steps slowly (a step every
# FIRST_RUN_SLEEP s) where the test waits for SLURM's own signal.
SRUN_JOB = """#!/bin/bash
#SBATCH --ntasks=2
#SBATCH --requeue
set -euo pipefail
if [ -z "${{SLURM_RESTART_COUNT:-}}" ]; then export STEP_SLEEP=${{FIRST_RUN_SLEEP:-0.05}}; fi
srun --kill-on-bad-exit=1 {python} {script} {out} {steps} ""
"""


def _submit(cluster: Cluster, out: Path, *argv: str, env: dict[str, str]) -> str:
    env = {"XDG_CONFIG_HOME": str(out / "xdg"), "HF_HOME": str(out / "hf"), **env}  # no user config
    exported = ",".join(["ALL", *(f"{k}={v}" for k, v in env.items())])
    log = ["--open-mode=append", f"--output={out}/slurm-%j.out"]  # every run's output
    run = cluster.run("sbatch", "--parsable", f"--export={exported}", *log, f"--chdir={REPO}",
                      *argv)  # fmt: skip
    assert run.returncode == 0, run.stderr
    return run.stdout.strip().split(";")[0]


def _srun_job(cluster: Cluster, out: Path, port: int, *sbatch: str, sleep: float = 0.05) -> str:
    out.mkdir()
    script = out / "train.py"
    script.write_text(SCRIPT)
    job = out / "job.sh"
    job.write_text(SRUN_JOB.format(python=sys.executable, script=script, out=out, steps=STEPS))
    env = {"MASTER_PORT": str(port), "FIRST_RUN_SLEEP": str(sleep)}
    return _submit(cluster, out, *sbatch, str(job), env=env)


def _example_job(cluster: Cluster, out: Path, port: int) -> str:
    """examples/slurm.sbatch as shipped, sized for this machine: one node, 2 CPU processes."""
    out.mkdir()
    env = {"GPUS_PER_NODE": "2", "MASTER_PORT": str(port), "PATH": _path()}
    sized = ["--nodes=1", "--gpus-per-node=0", "--cpus-per-task=1"]
    char_lm = ["--out", str(out), "--steps", "12", "--ckpt_every", "4", "--eval_every", "6",
               "--batch_size", "4"]  # fmt: skip
    return _submit(cluster, out, *sized, str(REPO / "examples" / "slurm.sbatch"), *char_lm, env=env)


def _path() -> str:
    return f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # `accel` on PATH


def _when(ready: Callable[[], bool], cluster: Cluster, job: str, what: str) -> None:
    deadline = time.monotonic() + 240
    while not ready():
        state = cluster.job(job)
        assert state["JobState"] not in ENDED, (what, state, cluster.logs())
        assert time.monotonic() < deadline, (what, state, cluster.logs())
        time.sleep(0.1)


def _progress(out: Path, at_least: int) -> Callable[[], bool]:
    def ready() -> bool:
        text = (out / "progress-0").read_text() if (out / "progress-0").exists() else ""
        return text.isdigit() and int(text) >= at_least

    return ready


def _char_lm_steps(out: Path, at_least: int) -> Callable[[], bool]:
    def ready() -> bool:
        metrics = out / "metrics.jsonl"
        return metrics.exists() and metrics.read_text().count('"train_loss"') >= at_least

    return ready


def _ended_requeued_then_completed(cluster: Cluster, job: str) -> None:
    state = cluster.wait_done(job, timeout=300)
    assert (state["JobState"], state["Restarts"], state["ExitCode"]) == ("COMPLETED", "1", "0:0")
    runs = [record["JobState"] for record in cluster.completions(job)]
    assert runs == ["PENDING", "COMPLETED"], runs  # the requeued run went back to the queue


def _result(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"result-{r}.json").read_text()) for r in range(2)]


def _final_model(out: Path) -> dict[str, Any]:
    [last] = sorted((out / "checkpoints").glob("step-12"))
    return {k: v.tolist() for k, v in load_file(last / "model.safetensors").items()}


def _train_losses(out: Path) -> list[float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r["train_loss"] for r in map(json.loads, lines) if "train_loss" in r]


def test_every_way_slurm_stops_a_job_ends_requeued_then_completed_bit_identical(
    slurm: Cluster, tmp_path: Path
) -> None:
    ports = [int(port) for port in _ports(5)]
    reference = _srun_job(slurm, tmp_path / "reference", ports[0])
    # SLURM sends --signal's signal up to 60 s early (sbatch's manual; its time-limit check
    # runs every 30 s): under a 3-minute limit USR1@60 comes 60 to 120 s after the start. The
    # first run would last 24 steps of 6 s, past the latest signal, so it never ends by itself
    # first (with 72 s it sometimes did, COMPLETED unrequeued), and a stop at the next step
    # still leaves a minute before the limit.
    time_limit = _srun_job(slurm, tmp_path / "time-limit", ports[1], "--time=3",
                           "--signal=USR1@60", sleep=6.0)  # fmt: skip
    admin = _srun_job(slurm, tmp_path / "admin", ports[2])
    example_ref = _example_job(slurm, tmp_path / "example-reference", ports[3])
    example = _example_job(slurm, tmp_path / "example", ports[4])

    # scancel --signal=USR1: to every task of the job's steps (the launchers), not the shell
    _when(_char_lm_steps(tmp_path / "example", 3), slurm, example, "the example's third step")
    cancel = slurm.run("scancel", "--signal=USR1", example)
    assert cancel.returncode == 0, cancel.stderr
    # an administrator requeues a running job: SLURM sends its steps SIGTERM
    _when(_progress(tmp_path / "admin", 3), slurm, admin, "the admin job's third step")
    requeue = slurm.run("scontrol", "requeue", admin)
    assert requeue.returncode == 0, requeue.stderr
    # --signal=USR1@60 under a three-minute limit: SLURM signals the tasks by itself; the
    # requeued run gets a longer limit, as an administrator would give it, lest SLURM signal
    # it again before it ends
    _when(lambda: slurm.job(time_limit)["Restarts"] == "1", slurm, time_limit, "the requeue")
    longer = slurm.run("scontrol", "update", f"JobId={time_limit}", "TimeLimit=30")
    assert longer.returncode == 0, longer.stderr

    state = slurm.wait_done(reference, timeout=300)
    assert (state["JobState"], state["Restarts"]) == ("COMPLETED", "0")  # finished: never requeued
    assert [r["JobState"] for r in slurm.completions(reference)] == ["COMPLETED"]
    for job, name in ((time_limit, "time-limit"), (admin, "admin")):
        _ended_requeued_then_completed(slurm, job)
        assert _result(tmp_path / name) == _result(tmp_path / "reference"), name  # bit for bit
        log = next((tmp_path / name).glob("slurm-*.out")).read_text()
        assert "accel.preemption: pre-empted by" in log, log
    time_limit_log = next((tmp_path / "time-limit").glob("slurm-*.out")).read_text()
    assert "pre-empted by SIGUSR1; SLURM job" in time_limit_log
    assert f"requeued (scontrol requeue {time_limit})" in time_limit_log

    state = slurm.wait_done(example_ref, timeout=300)
    assert (state["JobState"], state["Restarts"]) == ("COMPLETED", "0")
    _ended_requeued_then_completed(slurm, example)
    example_log = next((tmp_path / "example").glob("slurm-*.out")).read_text()
    assert f"pre-empted by SIGUSR1; SLURM job {example} requeued" in example_log
    assert _train_losses(tmp_path / "example") == _train_losses(tmp_path / "example-reference")
    assert _final_model(tmp_path / "example") == _final_model(tmp_path / "example-reference")
    _nothing_left_running()


def _nothing_left_running() -> None:
    """No job process is left (slurmstepd takes a moment to end after its job)."""
    deadline = time.monotonic() + 30
    while (left := leftovers(os.getpid())) and time.monotonic() < deadline:
        time.sleep(0.2)
    commands = [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ") for pid in left]
    assert left == [], commands


def test_python_in_the_batch_script_of_a_two_task_job_fails_at_once(
    slurm: Cluster, tmp_path: Path
) -> None:
    # `sbatch --ntasks=2` with `python train.py` but no srun: the batch script is no task;
    # before, it was taken for rank 0 and waited for rank 1 until the time limit
    script = tmp_path / "hello.py"
    script.write_text("import accel\naccel.init_distributed()\n")
    wrap = f"--wrap={sys.executable} {script}"
    job = _submit(slurm, tmp_path, "--ntasks=2", "--time=1", wrap, env={})
    state = slurm.wait_done(job, timeout=120)
    assert (state["JobState"], state["ExitCode"]) == ("FAILED", "1:0")
    log = next(tmp_path.glob("slurm-*.out")).read_text()
    assert "init_distributed: SLURM_NTASKS=2 but this process is not one of srun's tasks" in log
    _nothing_left_running()
