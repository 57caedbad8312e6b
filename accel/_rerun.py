"""How a pre-empted run tells its engine "not finished, run me again", and the signal held
from `init_distributed` until `accel.preemption` takes it.

Each engine reads "run again" in its own language:
- SLURM reads a job's exit code as its result (0: COMPLETED) and requeues a job only when
  asked, so the job is requeued with `scontrol requeue $SLURM_JOB_ID` (as Lightning's SLURM
  environment does); `#SBATCH --requeue` or slurm.conf's JobRequeue=1 must allow it.
- Kubeflow's training-operator, with `restartPolicy: ExitCode`, restarts a pod whose container
  exits with a retryable code: 128 or more since v1.7 (pkg/util/train/train_util.go,
  `IsRetryableExitCode`); earlier versions retried 130, 137, 143 and 138, the last "for user
  defined retryable error". 138 is retried by both, and a Job's `podFailurePolicy` can name it.
- torchrun's `--max-restarts` restarts workers that exit non-zero; a wrapper reads the code.
- Ray Train's `FailureConfig` retries a training function that raises.

Pure decisions here (unit-tested from a plain dict); `accel.distributed` passes the real
environment in, and `accel.preemption` acts on the plan.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Literal

PREEMPTED_EXIT_CODE = 138
"""The exit code of a run stopped by a pre-emption and saved: Kubeflow's retryable code for
user-defined retries (128 + SIGUSR1), read by torchrun's --max-restarts and a wrapper too."""

Rerun = Literal["auto", "requeue", "raise"] | int
"""`accel.preemption(rerun=...)`: choose from the environment, requeue the SLURM job, raise
(Ray Train's FailureConfig retries), or exit with this code (0: the run reports finished)."""

JOINED_GROUP = "existing default group (not accel's: shutdown leaves it)"
"""`ctx.sources["process_group"]` for a group another framework (Ray Train) created."""

HELD_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""What `init_distributed` holds for `accel.preemption`: its default signals."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RerunPlan:
    """How the process ends after an agreed pre-emption stop."""

    how: Literal["requeue", "exit", "raise"]
    exit_code: int  # the process's exit code ("requeue" too: after the requeue request)
    engine: str  # who reads it, for the one line the main process prints
    job_id: str | None = None  # the SLURM job to requeue


def plan_rerun(rerun: object, environ: Mapping[str, str], *, joined_group: bool) -> RerunPlan:
    """Decide how a pre-empted run ends, from `rerun` and the engine's own variables.

    "auto": a SLURM job (SLURM_JOB_ID) is requeued; a process group another framework made
    (Ray Train's) gets an exception; every other engine (Kubernetes, torchrun, mpirun, a plain
    process) gets exit code 138.

    Example:
        >>> plan_rerun("auto", {"SLURM_JOB_ID": "42"}, joined_group=False).how
        'requeue'
        >>> plan_rerun("auto", {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, joined_group=False)
        RerunPlan(how='exit', exit_code=138, engine='Kubernetes', job_id=None)
    """
    allowed = "'auto', 'requeue', 'raise' or an exit code 0..255"
    if isinstance(rerun, bool) or not (
        rerun in ("auto", "requeue", "raise") or (isinstance(rerun, int) and 0 <= rerun <= 255)
    ):
        raise ValueError(
            f"preemption: rerun={rerun!r} is not a way to end a pre-empted run; expected "
            f"{allowed}. Leave rerun='auto' to let the engine's variables choose."
        )
    job_id = environ.get("SLURM_JOB_ID")
    if rerun == "requeue" and not job_id:
        raise ValueError(
            "preemption: rerun='requeue' needs a SLURM job, and SLURM_JOB_ID is not set; "
            f"expected {allowed}. Run under sbatch, or pass rerun=138 for an exit code."
        )
    if isinstance(rerun, int):
        return RerunPlan(how="exit", exit_code=rerun, engine=_engine(environ))
    if rerun == "requeue" or (rerun == "auto" and job_id and not joined_group):
        return RerunPlan(
            how="requeue",
            exit_code=PREEMPTED_EXIT_CODE,
            engine=f"SLURM job {job_id}",
            job_id=job_id,
        )
    if rerun == "raise" or joined_group:
        return RerunPlan(how="raise", exit_code=PREEMPTED_EXIT_CODE, engine="Ray Train")
    return RerunPlan(how="exit", exit_code=PREEMPTED_EXIT_CODE, engine=_engine(environ))


def rerun_plan(sources: Mapping[str, str], rerun: object) -> RerunPlan:
    """`plan_rerun` for this process: the engine's variables as init_distributed read them."""
    joined = sources.get("process_group") == JOINED_GROUP
    return plan_rerun(rerun, os.environ, joined_group=joined)


def _engine(environ: Mapping[str, str]) -> str:
    if "KUBERNETES_SERVICE_HOST" in environ:  # in every pod (the API server's service)
        return "Kubernetes"
    if "TORCHELASTIC_RUN_ID" in environ:  # set by torchrun's agent (accel launch)
        return "torchrun"
    if "SLURM_JOB_ID" in environ:
        return f"SLURM job {environ['SLURM_JOB_ID']}"
    return "the caller"


class HeldSignal:
    """The handler `init_distributed` installs for SIGTERM and SIGUSR1 from its start.

    A pre-emption signal that arrives before the loop's `accel.preemption` block (during
    start-up: the rendezvous, data and model set-up, the first compile) is held here; the block
    takes it as this rank's signal when entered, so the loop stops at its first step on every
    rank and ends as the engine reads "run again". A second signal of the same kind ends the
    process as the default action would (a script without `accel.preemption` still stops when
    asked twice, and the engine's SIGKILL after its grace period ends it in any case).
    """

    def __init__(self) -> None:
        self.received: str | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = name
            print(
                f"accel: {name} received outside accel.preemption (during start-up); held: the "
                "loop stops at its first step inside accel.preemption(ctx) (a second one ends "
                "the process).",
                file=sys.stderr,
                flush=True,
            )
            return
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

    def take(self) -> str | None:
        """The held signal's name, once: the `preemption` block that takes it acts on it."""
        received, self.received = self.received, None
        return received


def hold_signals() -> None:
    """Install a `HeldSignal` for each of `HELD_SIGNALS` whose handler is still the default."""
    holder = HeldSignal()
    for sig in HELD_SIGNALS:
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, holder)


def release_signals() -> None:
    """Give back the default action to the signals `hold_signals` held (at `shutdown`)."""
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread sets handlers, and hold_signals ran there if at all
    for sig in HELD_SIGNALS:
        if isinstance(signal.getsignal(sig), HeldSignal):
            signal.signal(sig, signal.SIG_DFL)
