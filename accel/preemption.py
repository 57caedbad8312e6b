"""Turn a cluster's pre-emption signal into a clean stop at an optimizer-step boundary.

Clusters stop a job with a signal and a grace period: Kubernetes sends SIGTERM to each pod,
SLURM sends what `--signal=USR1@90` names and later SIGTERM, and torchrun's agent (`accel
launch`) sends the signal it got to every worker. The signal may reach one rank only. Inside
`preemption(ctx)` such a signal only sets a flag on the rank that got it; `requested()`, called
on every rank at the same optimizer steps, combines the flags with one small collective, so
every rank sees the stop at the same step and saves. Leaving the block after that stop ends
the process the way its engine reads "not finished, run me again" (accel/_rerun.py): the
SLURM job is requeued, Kubernetes and torchrun get exit code 138, Ray Train an exception.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from accel._groups import comm_device, named_collective, require_group
from accel._rerun import HELD_SIGNALS, HeldSignal, Rerun, RerunPlan, rerun_plan
from accel.context import RunContext
from accel.process_control import wait_for_everyone

__all__ = ["Preemption", "preemption"]

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
"""Kubernetes' and torchrun's stop signal, and the one SLURM examples name in `--signal`."""
RAY_NOTICE = "Ray Train's pre-emption notice"
"""`stop.signal` when Ray Train's `get_preemption_info()` stopped the run."""


class Preemption:
    """The stop flag of one `preemption` scope; ask it at optimizer-step boundaries.

    Attributes:
        received: the name of the first signal this rank received inside the scope, or held
            since `init_distributed` (e.g. "SIGTERM"), or None; only the ranks the signal
            reached have one.
        signal: once `requested()` is True, the name of a signal that stopped the run, the
            same on every rank (the highest-numbered one any rank received), or under Ray
            Train "Ray Train's pre-emption notice"; None before.
    """

    def __init__(
        self, ctx: RunContext, every: int, notice: Callable[[], object] | None = None
    ) -> None:
        self._ctx = ctx
        self._every = every
        self._notice = notice  # Ray Train's agreed pre-emption notice, asked instead of signals
        self._calls = 0
        self._agreed = False
        self.received: str | None = None
        self.signal: str | None = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only set a flag: the handler may run in the middle of a save or a collective, which
        # must finish; the loop acts on it at its next optimizer-step boundary.
        if self.received is None:
            self.received = signal.Signals(signum).name

    def requested(self) -> bool:
        """Return True on every rank once a signal reached any rank: save and stop now.

        Call it on every rank at the same points, once per optimizer step (after the step,
        where a checkpoint is consistent). Every `every`-th call combines the ranks' signals
        with one all-reduce of one integer; the other calls return False without communicating.
        Once True it stays True, without further communication.

        Returns:
            True, the same on every rank, when a handled signal reached any rank.

        Raises:
            RuntimeError: when `world_size > 1` and no process group is initialised, or the
                collective fails (another rank did not make the same call).
        """
        if self._agreed:
            return True
        self._calls += 1
        if self._calls % self._every:
            return False
        if self._notice is not None:  # the same answer on every worker: Ray agrees on it
            self._agreed = self._notice() is not None
            self.signal = RAY_NOTICE if self._agreed else None
            return self._agreed
        number = int(signal.Signals[self.received]) if self.received is not None else 0
        if self._ctx.world_size > 1:
            value = torch.tensor([number], device=comm_device(self._ctx))
            group = require_group(self._ctx, "Preemption.requested")
            with named_collective(self._ctx, "Preemption.requested"):
                dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
            number = int(value.item())
        self._agreed = number > 0
        self.signal = signal.Signals(number).name if number else None
        return self._agreed


def _signals(names: Sequence[str | signal.Signals]) -> list[signal.Signals]:
    allowed = "signal names such as 'SIGTERM' or 'SIGUSR1', or signal.Signals members"
    if isinstance(names, (str, bytes)) or not names:
        raise ValueError(
            f"preemption: signals={names!r} is not a non-empty sequence of signals; expected "
            f"{allowed}. Pass e.g. signals=('SIGTERM', 'SIGUSR1')."
        )
    out: list[signal.Signals] = []
    for name in names:
        if isinstance(name, signal.Signals):
            sig = name
        elif isinstance(name, str) and isinstance(getattr(signal, name, None), signal.Signals):
            sig = signal.Signals[name]
        else:
            raise ValueError(
                f"preemption: signals contains {name!r}, which is not a signal; expected "
                f"{allowed}. Pass e.g. signals=('SIGTERM', 'SIGUSR1')."
            )
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(
                f"preemption: signals contains {sig.name}, which no process can handle; "
                f"expected {allowed}. Leave {sig.name} out."
            )
        out.append(sig)
    return out


@contextlib.contextmanager
def preemption(
    ctx: RunContext,
    *,
    signals: Sequence[str | signal.Signals] = DEFAULT_SIGNALS,
    every: int = 1,
    rerun: Rerun = "auto",
) -> Iterator[Preemption]:
    """Within the block, a pre-emption signal on any rank stops every rank at the same step.

    Enter it on every rank, around the training loop, in the main thread (Python runs signal
    handlers only there); inside a Ray Train training function (Ray runs it in a thread) the
    block hears Ray's own pre-emption notice instead (`ray.train.get_preemption_info()`, which
    Ray agrees across workers; a node drained for pre-emption sets it) and installs no signal
    handler. Inside, each signal in `signals` only marks this rank; ask
    `stop.requested()` on every rank after each optimizer step, and when it says True save
    with `save_checkpoint` and leave the block (`break`, `return`, or `sys.exit()`). Leaving
    it after such a stop ends the process the way its engine reads "not finished, run me
    again", once every rank got there: a SLURM job is requeued (`scontrol requeue
    $SLURM_JOB_ID` from rank 0) and exits 138; a Ray Train worker (a process group Ray made)
    raises `RuntimeError`, which `FailureConfig(max_failures=...)` retries; anything else
    (Kubernetes, torchrun, mpirun, a plain process) exits with code 138, which Kubeflow's
    `restartPolicy: ExitCode`, a Job's `podFailurePolicy`, torchrun's `--max-restarts` and a
    wrapper read. The next run resumes from `latest_checkpoint`. A loop that runs to its end
    leaves the block as any block, and the script exits 0.

    A signal that arrives during a save, or during a collective, waits until it is done. A
    signal held since `init_distributed` (start-up: rendezvous, set-up, first compile) counts
    as received here. The handlers that were installed before are restored when the block
    ends.

    Under `accel launch` (torchrun's agent) signal the launcher: the agent sends the signal to
    every worker of its node and waits for them (`--shutdown_timeout`, 30 s by default); the
    launcher then exits 138 too. Under srun without a launcher SLURM signals every task;
    `--signal=USR1@90` gives the loop 90 s before the SIGTERM and SIGKILL that follow.

    Args:
        ctx: the run context; the flags are combined over `ctx.process_group`.
        signals: the signals to catch, by name or as `signal.Signals`; default SIGTERM and
            SIGUSR1.
        every: combine the flags on every `every`-th `requested()` call only (one all-reduce
            of one integer each time), the others answer False at once; default 1.
        rerun: how a stopped run ends: "auto" (chosen from the engine's variables, as
            above), "requeue" (SLURM), "raise" (Ray Train), or an exit code; 0 leaves the
            block as after a finished run, for a script that decides itself.

    Yields:
        A `Preemption`; `stop.requested()` is the agreed answer, `stop.signal` the signal that
        stopped the run (on every rank), `stop.received` the one this rank got.

    Raises:
        ValueError: for an unknown signal, SIGKILL or SIGSTOP, an `every` that is not an
            int >= 1, a `rerun` that is not one of the above, or rerun="requeue" outside a
            SLURM job.
        RuntimeError: when entered in a thread other than the main thread, outside Ray Train;
            on leaving after a stop, with rerun="raise" (Ray Train's default).
        SystemExit: on leaving after a stop, with the exit code (138 by default).

    Example:
        >>> from accel import preemption, RunContext
        >>> with preemption(RunContext()) as stop:
        ...     for step in range(3):
        ...         pass  # forward, backward, optimizer step
        ...         if stop.requested():
        ...             break  # save_checkpoint(ctx, root, state, step=step) first
        >>> stop.requested(), stop.received
        (False, None)
    """
    sigs = _signals(signals)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(
            f"preemption: every={every!r} is not an int >= 1; it is how many requested() calls "
            "make one check. Pass every=1 to check at every optimizer step."
        )
    plan = rerun_plan(ctx.sources, rerun)
    notice = _ray_notice()
    if notice is None and threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            f"preemption: entered in thread {threading.current_thread().name!r}; Python runs "
            "signal handlers only in the main thread. Enter it in the main thread, around the "
            "training loop (under Ray Train, one whose ray.train has get_preemption_info)."
        )
    stop = Preemption(ctx, every, notice)
    previous: dict[signal.Signals, Any] = {}
    if notice is None:  # Ray Train's workers hear Ray's notice; every other process, signals
        for sig in sigs:  # a signal init_distributed held during start-up is this block's now
            held = signal.getsignal(sig)
            if isinstance(held, HeldSignal) and (taken := held.take()) and stop.received is None:
                stop.received = taken
        previous = {sig: signal.signal(sig, stop._on_signal) for sig in sigs}
    try:
        yield stop
    except SystemExit as err:
        if not (stop._agreed and err.code in (None, 0)):
            raise
    finally:
        for sig, handler in previous.items():
            # None: a handler not installed from Python; the default is the closest restore.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    if stop._agreed and plan.exit_code != 0:
        _end(ctx, stop, plan)


def _end(ctx: RunContext, stop: Preemption, plan: RerunPlan) -> None:
    """End a stopped run the way `plan` says: requeue, raise, or exit with its code."""
    what = f"pre-empted by {stop.signal}"
    for sig in {*HELD_SIGNALS, *_signals(DEFAULT_SIGNALS)} if stop._notice is None else ():
        # Saved and ending: a later stop signal changes nothing (SLURM ends a requeued job's
        # steps with SIGTERM); the exit code stays the plan's, and the engine's SIGKILL bounds it.
        signal.signal(sig, signal.SIG_IGN)
    if plan.how == "raise":
        raise RuntimeError(
            f"preemption: {what} on rank {ctx.rank}; the loop saved and stopped. Raised so "
            f"that {plan.engine}'s FailureConfig(max_failures=...) restarts the run from its "
            "latest checkpoint."
        )
    if plan.how == "requeue":
        if ctx.world_size == 1 or dist.is_initialized():  # not after the script's shutdown()
            wait_for_everyone(ctx)  # every rank's save is done before SLURM ends the job
        if ctx.is_main:
            _requeue(what, plan)
    elif ctx.is_main:
        print(
            f"accel.preemption: {what}; exiting with code {plan.exit_code} so that "
            f"{plan.engine} runs the job again.",
            file=sys.stderr,
            flush=True,
        )
    raise SystemExit(plan.exit_code)


def _ray_notice() -> Callable[[], object] | None:
    """Ray Train's `get_preemption_info` inside one of its training functions, else None.

    Ray Train (2.60) runs the training function in a thread of its worker process, where Python
    runs no signal handler, and hears of a pre-emption itself: a node being drained for
    pre-emption (a spot reclaim, `ray drain-node`) is marked on every worker, and
    `get_preemption_info()` answers the same on every worker (it is a barrier across them).
    """
    train = sys.modules.get("ray.train")  # only where Ray Train started this process's group
    notice = getattr(train, "get_preemption_info", None)
    if train is None or notice is None:
        return None
    try:
        train.get_context()
    except RuntimeError:  # not inside a training function Ray Train runs
        return None
    return notice  # type: ignore[no-any-return]


def _requeue(what: str, plan: RerunPlan) -> None:
    command = ["scontrol", "requeue", str(plan.job_id)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        said = done.stderr.strip() or done.stdout.strip() or f"exit code {done.returncode}"
        failure = said if done.returncode else ""
    except (OSError, subprocess.TimeoutExpired) as err:
        failure = str(err)
    if "pending" in failure.lower():  # requeued already (an administrator's scontrol requeue)
        failure = ""
    if not failure:
        print(
            f"accel.preemption: {what}; SLURM job {plan.job_id} requeued ({' '.join(command)}): "
            "it runs again and resumes from the newest checkpoint.",
            file=sys.stderr,
            flush=True,
        )
        return
    print(
        f"accel.preemption: {what}; `{' '.join(command)}` failed: {failure}. The job ends "
        f"with exit code {plan.exit_code} instead; allow requeues with `#SBATCH --requeue` "
        "(or JobRequeue=1 in slurm.conf), or resubmit it.",
        file=sys.stderr,
        flush=True,
    )
