"""Turn a cluster's pre-emption signal into a clean stop at an optimizer-step boundary.

Clusters stop a job with a signal and a grace period: Kubernetes sends SIGTERM to each pod,
SLURM sends what `--signal=USR1@90` names and later SIGTERM, and torchrun's agent (`accel
launch`) sends the signal it got to every worker. The signal may reach one rank only. Inside
`preemption(ctx)` such a signal only sets a flag on the rank that got it; `requested()`, called
on every rank at the same optimizer steps, combines the flags with one small collective, so
every rank sees the stop at the same step, saves, and exits 0.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator, Sequence
from types import FrameType

from accel.context import RunContext
from accel.process_control import any_rank

__all__ = ["Preemption", "preemption"]

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
"""Kubernetes' and torchrun's stop signal, and the one SLURM examples name in `--signal`."""


class Preemption:
    """The stop flag of one `preemption` scope; ask it at optimizer-step boundaries.

    Attributes:
        received: the name of the first signal this rank received inside the scope (e.g.
            "SIGTERM"), or None; only the ranks the signal reached have one.
    """

    def __init__(self, ctx: RunContext, every: int) -> None:
        self._ctx = ctx
        self._every = every
        self._calls = 0
        self._agreed = False
        self.received: str | None = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only set a flag: the handler may run in the middle of a save or a collective, which
        # must finish; the loop acts on it at its next optimizer-step boundary.
        if self.received is None:
            self.received = signal.Signals(signum).name

    def requested(self) -> bool:
        """Return True on every rank once a signal reached any rank: save and stop now.

        Call it on every rank at the same points, once per optimizer step (after the step,
        where a checkpoint is consistent). Every `every`-th call combines the ranks' flags with
        one all-reduce of one integer; the other calls return False without communicating. Once
        True it stays True, without further communication.

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
        self._agreed = any_rank(self._ctx, self.received is not None)
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
) -> Iterator[Preemption]:
    """Within the block, a pre-emption signal on any rank stops every rank at the same step.

    Enter it on every rank, around the training loop, in the main thread (Python runs signal
    handlers only there). Inside, each signal in `signals` only marks this rank; ask
    `stop.requested()` on every rank after each optimizer step, and when it says True save
    with `save_checkpoint` and leave with exit code 0: the resubmitted job resumes from
    `latest_checkpoint`. A signal that arrives during a save, or during a collective, waits
    until it is done. The handlers that were installed before are restored when the block
    ends, so nothing outlives it.

    Under `accel launch` (torchrun's agent) signal the launcher: the agent sends the signal to
    every worker of its node and waits for them (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s), and
    the launcher exits 0 when they all did. Under srun without a launcher SLURM signals every
    task; `--signal=USR1@90` gives the loop 90 s before the SIGTERM and SIGKILL that follow.

    Args:
        ctx: the run context; the flags are combined over `ctx.process_group`.
        signals: the signals to catch, by name or as `signal.Signals`; default SIGTERM and
            SIGUSR1.
        every: combine the flags on every `every`-th `requested()` call only (one all-reduce
            of one integer each time), the others answer False at once; default 1.

    Yields:
        A `Preemption`; `stop.requested()` is the agreed answer, `stop.received` the signal
        this rank got.

    Raises:
        ValueError: for an unknown signal, SIGKILL or SIGSTOP, or an `every` that is not an
            int >= 1.
        RuntimeError: when entered in a thread other than the main thread.

    Example:
        >>> from accel import preemption, RunContext
        >>> with preemption(RunContext()) as stop:
        ...     for step in range(3):
        ...         pass  # forward, backward, optimizer step
        ...         if stop.requested():
        ...             break  # save_checkpoint(ctx, root, state, step=step), then exit 0
        >>> stop.requested(), stop.received
        (False, None)
    """
    sigs = _signals(signals)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(
            f"preemption: every={every!r} is not an int >= 1; it is how many requested() calls "
            "make one check. Pass every=1 to check at every optimizer step."
        )
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            f"preemption: entered in thread {threading.current_thread().name!r}; Python runs "
            "signal handlers only in the main thread. Enter it in the main thread, around the "
            "training loop."
        )
    stop = Preemption(ctx, every)
    previous = {sig: signal.signal(sig, stop._on_signal) for sig in sigs}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            # None: a handler not installed from Python; the default is the closest restore.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
