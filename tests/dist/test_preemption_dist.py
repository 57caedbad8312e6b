"""Pre-emption with real signals at 2 ranks: stop at a step boundary, save, exit 0, resume exactly.

The scheduler's part is played by this test: it sends the signal as SLURM or Kubernetes does,
to the launcher process (`accel launch`, where torchrun's agent forwards it to the workers) or
to one srun task only. Every interrupted run ends with exit code 138 ("not finished, run me
again"; no SLURM_JOB_ID here, so nothing to requeue), is resubmitted, and must end with the
losses and parameters, bit for bit, of the uninterrupted run (srun-style, the reference).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import accel
from tests.cli.test_cli import _env as cli_env
from tests.dist.test_distributed_dist import _free_port
from tests.processes import leftovers

STEPS = 24
REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, os, signal, sys, time
from pathlib import Path
import torch
import accel

out, steps, save_signal = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
setup_s = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0  # a slow start-up, first run only
ctx = accel.init_distributed(seed=0)
if setup_s and not (out / "ckpt").exists():
    (out / f"started-{ctx.rank}").touch()
    time.sleep(setup_s)  # data and model set-up, a first compile: before accel.preemption
accel.set_seed(0, ctx=ctx)
model = accel.wrap_model(ctx, torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)


class History:  # loop state saved with the checkpoint: the losses so far
    def __init__(self):
        self.losses, self.step, self.sent = [], 0, False

    def state_dict(self):
        if save_signal and ctx.rank == 0 and self.step == 8 and not self.sent:
            # a real signal, delivered while save_checkpoint runs (rank 0 writes this object)
            self.sent = True
            os.kill(os.getpid(), getattr(signal, save_signal))
        return {"losses": self.losses, "step": self.step}

    def load_state_dict(self, state):
        self.losses, self.step = list(state["losses"]), int(state["step"])


history = History()
state = {"model": model, "optimizer": optimizer, "history": history}
root = out / "ckpt"
if (latest := accel.latest_checkpoint(root)) is not None:
    accel.load_state(ctx, latest, state)
with accel.preemption(ctx) as stop:
    while history.step < steps:
        x = torch.randn(8, 4)  # each rank's RNG stream is restored from the checkpoint
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        accel.scaled_backward(ctx, loss)
        accel.optimizer_step(ctx, optimizer)
        optimizer.zero_grad()
        history.step += 1
        history.losses.append(accel.reduce(ctx, loss.detach(), op="mean").item())
        progress = out / f"progress-{ctx.rank}"  # whole or absent: the test polls it
        progress.with_suffix(".tmp").write_text(str(history.step))
        os.replace(progress.with_suffix(".tmp"), progress)
        stopping = stop.requested()
        if stopping or history.step % 4 == 0:
            accel.save_checkpoint(ctx, root, state, step=history.step, keep=3)
        if stopping:
            if ctx.is_main:
                print(f"pre-empted at step {history.step}; saved {root}/step-{history.step}")
            with open(out / "stops.jsonl", "a") as f:
                f.write(json.dumps({"rank": ctx.rank, "step": history.step,
                                    "received": stop.received, "signal": stop.signal}) + "\\n")
            break  # leaving the block ends the process: exit code 138, "run me again"
        time.sleep(float(os.environ.get("STEP_SLEEP", "0.05")))
params = [p.tolist() for p in accel.unwrap_model(model).parameters()]
(out / f"result-{ctx.rank}.json").write_text(json.dumps({"losses": history.losses,
                                                         "params": params}))
accel.shutdown(ctx)
"""


def _environment(tmp: Path, tag: str) -> dict[str, str]:
    drop = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
    env = {k: v for k, v in cli_env(tmp).items() if "SLURM" not in k and k not in drop}
    env["PREEMPTION_TEST_TAG"] = tag  # finds every process the test started, reparented too
    return env


def _srun(script: Path, out: Path, tag: str, save_signal: str = "") -> list[subprocess.Popen[str]]:
    # What srun sets for `srun --ntasks 2 python train.py` on one node (SLURM's srun(1) "OUTPUT
    # ENVIRONMENT VARIABLES"), less SLURM_JOB_ID: a job id would make the stop requeue that
    # job (tests/cli/test_slurm.py does that on real daemons); the port is MASTER_PORT.
    port = _free_port(15000 + os.getpid() % 4000, 20000)
    env = _environment(out, tag)
    env.update(
        SLURM_NTASKS="2", SLURM_NODELIST="localhost", SLURM_STEP_ID="0", MASTER_PORT=str(port)
    )
    return [
        subprocess.Popen(
            [sys.executable, str(script), str(out), str(STEPS), save_signal],
            env={**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=out,
        )
        for r in range(2)
    ]


def _launch(script: Path, out: Path, tag: str, setup_s: float = 0) -> list[subprocess.Popen[str]]:
    argv = [sys.executable, "-m", "accel", "launch", "--num_processes", "2", "--monitor_interval",
            "0.2", str(script), str(out), str(STEPS), "", str(setup_s)]  # fmt: skip
    env = _environment(out, tag)
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=out)  # fmt: skip
    return [proc]


def _wait(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str]]:
    return [(p.wait(timeout=180), p.communicate()[0]) for p in procs]


def _signal_at(procs: list[subprocess.Popen[str]], target: int, out: Path, sig: int) -> None:
    """Send `sig` to `procs[target]` once rank 0 has taken 3 optimizer steps."""
    deadline = time.monotonic() + 120
    progress = out / "progress-0"
    while not (progress.exists() and int(progress.read_text()) >= 3):
        assert time.monotonic() < deadline, "the run never reached step 3"
        assert all(p.poll() is None for p in procs), _wait(procs)
        time.sleep(0.05)
    procs[target].send_signal(sig)


def _result(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"result-{r}.json").read_text()) for r in range(2)]


def _stops(out: Path) -> list[dict[str, Any]]:
    lines = (out / "stops.jsonl").read_text().splitlines()
    return sorted((json.loads(line) for line in lines), key=lambda s: s["rank"])


def _tagged(tag: str) -> list[int]:
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"PREEMPTION_TEST_TAG={tag}".encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:  # ended while we looked, or not ours
            continue
    return found


@pytest.fixture
def tag() -> Any:
    value = uuid.uuid4().hex
    yield value
    left, tagged = leftovers(os.getpid()), _tagged(value)
    for pid in {*left, *tagged}:  # a failed test's processes must not load the tests after it
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert left == []
    assert tagged == [], "a process the test started is still running"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("uninterrupted")
    script = out / "train.py"
    script.write_text(SCRIPT)
    tag = uuid.uuid4().hex
    runs = _wait(_srun(script, out, tag))
    assert [code for code, _ in runs] == [0, 0], runs
    assert _tagged(tag) == []
    result = _result(out)
    assert len(result[0]["losses"]) == STEPS
    assert result[0] == result[1]
    return result


def _resume_and_compare(out: Path, start: Any, reference: list[dict[str, Any]]) -> None:
    runs = _wait(start())
    assert [code for code, _ in runs] == [0] * len(runs), runs
    assert _result(out) == reference  # losses and parameters, bit for bit


def test_sigusr1_to_accel_launch_stops_every_rank_saves_and_exits_0(
    tmp_path: Path, reference: list[dict[str, Any]], tag: str
) -> None:
    # SLURM's `#SBATCH --signal=USR1@90` with `srun accel launch ...`: the launcher gets it.
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    procs = _launch(script, tmp_path, tag)
    _signal_at(procs, 0, tmp_path, signal.SIGUSR1)
    [(code, output)] = _wait(procs)
    assert code == 138, output  # not finished: run me again
    stops = _stops(tmp_path)
    assert [s["step"] for s in stops] == [stops[0]["step"]] * 2  # the same step on both ranks
    assert [s["received"] for s in stops] == ["SIGUSR1", "SIGUSR1"]  # the agent forwarded it
    assert f"pre-empted at step {stops[0]['step']}; saved" in output
    assert "SIGUSR1 received; every worker of this node saved and stopped: exit code 138" in output
    assert stops[0]["step"] < STEPS
    _resume_and_compare(tmp_path, lambda: _launch(script, tmp_path, tag), reference)


def test_sigterm_to_one_srun_task_stops_both_at_the_same_step(
    tmp_path: Path, reference: list[dict[str, Any]], tag: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    procs = _srun(script, tmp_path, tag)
    _signal_at(procs, 1, tmp_path, signal.SIGTERM)  # rank 1 only
    runs = _wait(procs)
    assert [code for code, _ in runs] == [138, 138], runs
    stops = _stops(tmp_path)
    assert stops[0]["step"] == stops[1]["step"] < STEPS
    assert [s["received"] for s in stops] == [None, "SIGTERM"]  # rank 0 learned it by agreement
    assert [s["signal"] for s in stops] == ["SIGTERM", "SIGTERM"]  # and which signal it was
    assert runs[0][1].count("pre-empted at step") == 1  # one line, from the main process
    assert "accel.preemption: pre-empted by SIGTERM; exiting with code 138" in runs[0][1]
    _resume_and_compare(tmp_path, lambda: _srun(script, tmp_path, tag), reference)


def test_a_signal_during_a_save_leaves_that_checkpoint_whole_and_stops_after_it(
    tmp_path: Path, reference: list[dict[str, Any]], tag: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    runs = _wait(_srun(script, tmp_path, tag, save_signal="SIGUSR1"))  # rank 0, saving step 8
    assert [code for code, _ in runs] == [138, 138], runs
    stops = _stops(tmp_path)
    assert [s["step"] for s in stops] == [9, 9]  # the save finished; the next boundary stopped
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-4", "step-8", "step-9"]
    assert [s["received"] for s in stops] == ["SIGUSR1", None]
    # the checkpoint being written when the signal came is complete and loads
    model, history, ctx = torch.nn.Linear(4, 1), _Plain(), accel.RunContext.single()
    rng = accel.get_rng_state()  # load_state restores the saved RNG states: keep this process's
    try:
        manifest = accel.load_state(ctx, tmp_path / "ckpt" / "step-8", model=model,
                                    history=history)  # fmt: skip
    finally:
        accel.set_rng_state(rng)
    assert manifest["step"] == 8 and history.state["step"] == 8
    _resume_and_compare(tmp_path, lambda: _srun(script, tmp_path, tag), reference)


class _Plain:
    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def _two_machines(script: Path, out: Path, tag: str, port: int) -> list[subprocess.Popen[str]]:
    """Two `accel launch` processes as two machines on the loopback, as two Kubernetes pods
    run them (examples/pytorchjob.yaml: static rendezvous at machine 0, no restarts)."""
    common = ["--num_machines", "2", "--num_processes", "2", "--main_process_ip", "127.0.0.1",
              "--main_process_port", str(port), "--monitor_interval", "0.2", str(script),
              str(out), str(STEPS), ""]  # fmt: skip
    env = _environment(out, tag)
    return [
        subprocess.Popen(
            [sys.executable, "-m", "accel", "launch", "--machine_rank", str(rank), *common],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=out,
        )
        for rank in (0, 1)
    ]


@pytest.mark.timeout(600)
def test_an_evicted_machine_and_the_other_both_end_at_once_with_138_and_resume_exactly(
    tmp_path: Path, reference: list[dict[str, Any]], tag: str
) -> None:
    # Kubernetes evicts one pod: only machine 1's launcher gets SIGTERM. Machine 0's workers
    # learn it by agreement, save and exit 138: its agent must not wait 300 s in torchrun's
    # exit barrier for an agent that stopped on a signal, and its launcher exits 138 too, so
    # that the operator restarts both pods (restartPolicy: ExitCode).
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    port = _free_port(20000 + os.getpid() % 4000, 25000)
    procs = _two_machines(script, tmp_path, tag, port)
    _signal_at(procs, 1, tmp_path, signal.SIGTERM)
    sent = time.monotonic()
    runs = _wait(procs)
    waited = time.monotonic() - sent
    assert [code for code, _ in runs] == [138, 138], runs
    assert waited < 60, (waited, runs)  # torchrun's exit barrier would hold machine 0 for 300 s
    assert "a pre-emption stopped the run; every worker of this node saved" in runs[0][1]
    assert "SIGTERM received; every worker of this node saved and stopped" in runs[1][1]
    stops = _stops(tmp_path)
    assert [s["received"] for s in stops] == [None, "SIGTERM"]
    assert [s["signal"] for s in stops] == ["SIGTERM", "SIGTERM"]
    _resume_and_compare(tmp_path, lambda: _two_machines(script, tmp_path, tag, port), reference)


def test_a_signal_during_start_up_is_held_and_stops_the_first_step(
    tmp_path: Path, reference: list[dict[str, Any]], tag: str
) -> None:
    # The scheduler's SIGTERM reaches the launcher while both workers are past
    # init_distributed but still setting up, before their accel.preemption block.
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    [launch] = _launch(script, tmp_path, tag, setup_s=3)
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"started-{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline and launch.poll() is None, _wait([launch])
        time.sleep(0.05)
    launch.send_signal(signal.SIGTERM)
    [(code, output)] = _wait([launch])
    assert code == 138, output  # not 143 with "Wrap the training loop in accel.preemption"
    assert "SIGTERM received outside accel.preemption (during start-up); held" in output
    assert "Wrap the training loop" not in output
    stops = _stops(tmp_path)
    assert [(s["step"], s["received"]) for s in stops] == [(1, "SIGTERM"), (1, "SIGTERM")]
    _resume_and_compare(tmp_path, lambda: _launch(script, tmp_path, tag), reference)


def _mpirun(script: Path, out: Path, tag: str, port: int) -> list[subprocess.Popen[str]]:
    """Open MPI's `mpirun -np 2 python train.py`, as root where needed (CI runs as root)."""
    env = {**_environment(out, tag), "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}  # fmt: skip
    argv = ["mpirun", "--oversubscribe", "-np", "2", "-x", f"MASTER_PORT={port}", "-x",
            "PYTHONPATH", "-x", "PREEMPTION_TEST_TAG", sys.executable, str(script), str(out),
            str(STEPS), ""]  # fmt: skip
    return [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, cwd=out)]  # fmt: skip


@pytest.fixture
def mpirun() -> None:
    if (
        shutil.which("mpirun") is None
        or "Open MPI"
        not in subprocess.run(
            ["mpirun", "--version"], capture_output=True, text=True, check=False
        ).stdout
    ):
        pytest.skip("Open MPI's mpirun is not installed here; `make cluster-engines` installs "
                    "Debian's openmpi-bin where apt is available")  # fmt: skip


def test_real_mpirun_forwards_sigusr1_and_ends_138_then_resumes_exactly(
    tmp_path: Path, reference: list[dict[str, Any]], tag: str, mpirun: None
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    port = _free_port(25000 + os.getpid() % 4000, 30000)
    procs = _mpirun(script, tmp_path, tag, port)
    _signal_at(procs, 0, tmp_path, signal.SIGUSR1)  # Open MPI's mpirun forwards SIGUSR1
    [(code, output)] = _wait(procs)
    assert code == 138, output  # mpirun exits with its ranks' code
    stops = _stops(tmp_path)
    assert [s["received"] for s in stops] == ["SIGUSR1", "SIGUSR1"]
    assert stops[0]["step"] == stops[1]["step"] < STEPS
    _resume_and_compare(tmp_path, lambda: _mpirun(script, tmp_path, tag, port), reference)


def test_real_mpirun_on_sigterm_exits_1_though_every_rank_saved(
    tmp_path: Path, tag: str, mpirun: None
) -> None:
    # what docs/scale-out.md says: mpirun passes SIGTERM on, the ranks save and exit 138, and
    # Open MPI's mpirun still exits 1; SIGUSR1 is the signal to send it
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    procs = _mpirun(script, tmp_path, tag, _free_port(30000 + os.getpid() % 4000, 35000))
    _signal_at(procs, 0, tmp_path, signal.SIGTERM)
    [(code, output)] = _wait(procs)
    assert code == 1, output
    stops = _stops(tmp_path)
    assert [s["received"] for s in stops] == ["SIGTERM", "SIGTERM"]
    assert (tmp_path / "ckpt" / f"step-{stops[0]['step']}").is_dir()
