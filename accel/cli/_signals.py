"""`accel launch` under a scheduler's stop signal: forward it to the workers, exit 0 if they do.

torchrun's agent handles the signals named by `--signals-to-handle` (PET_SIGNALS_TO_HANDLE):
its handler raises `SignalException`, the agent sends the same signal to every worker of its
node, waits for them up to TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s), kills the rest, and re-raises
(torch/distributed/elastic/agent/server/api.py, `SimpleElasticAgent.run`;
multiprocessing/api.py, `_terminate_process_handler` and `SubprocessContext._close`). Its
default list leaves out SIGUSR1 and SIGUSR2, which SLURM's `--signal` sends, so the agent would
die of them and leave the workers without the signal; accel adds them. A worker inside
`accel.preemption` stops at its next optimizer step, saves and exits 138 ("run me again"); the
launcher then exits 138 too, instead of torch's traceback for the agent's own exception. The
launcher of a machine that was not signalled sees its workers exit 138 as well: torchrun's
agent reads that as a failure, which skips its exit barrier (300 s of waiting for the
signalled machine's agent, which never arrives there), and the launcher exits 138 at once.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from accel._rerun import PREEMPTED_EXIT_CODE

SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
"""torchrun's default list plus SLURM's usual `--signal` choices."""


def agent_environment() -> dict[str, str]:
    """The torchrun defaults `accel launch` sets (a user's own PET_ variable wins)."""
    return {"PET_SIGNALS_TO_HANDLE": SIGNALS_TO_HANDLE}


def _worker_exit_codes(tb: TracebackType | None) -> dict[int, int | None] | None:
    """Each local worker's exit code, from the agent whose `run` the exception left."""
    # torch only once the agent has run: `accel --help` answers without importing torch.
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    while tb is not None:
        agent = tb.tb_frame.f_locals.get("self")
        if isinstance(agent, SimpleElasticAgent):
            handlers: Any = getattr(getattr(agent, "_pcontext", None), "subprocess_handlers", None)
            if not handlers:
                return None
            return {rank: h.proc.returncode for rank, h in handlers.items()}
        tb = tb.tb_next
    return None


def preempted_line(codes: Mapping[int, int | None], why: str) -> str | None:
    """The launcher's line when its workers stopped at a pre-emption (every one exited 138, or
    0 and 138), else None."""
    if not codes or set(codes.values()) - {0, PREEMPTED_EXIT_CODE}:
        return None
    if PREEMPTED_EXIT_CODE not in codes.values():
        return None
    return (
        f"accel launch: {why}; every worker of this node saved and stopped: exit code "
        f"{PREEMPTED_EXIT_CODE}, so the scheduler (or --max_restarts, or a wrapper) runs the "
        "job again."
    )


def exit_after_signal(err: Any) -> int:
    """The launcher's exit code once the agent stopped on a signal (`SignalException`).

    138 when the workers of this node stopped at a pre-emption and saved (they exited 138);
    0 when every worker exited 0 (the run finished, or the script chose rerun=0); otherwise
    128 + the signal number, as a shell reports a process killed by it, with one line (for
    Ctrl-C, only that the run stopped: the terminal sent it to every worker too).
    """
    name = signal.Signals(err.sigval).name
    codes = _worker_exit_codes(err.__traceback__)
    line = preempted_line(codes or {}, f"{name} received")
    if line is not None:
        print(line, file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    if codes and all(code == 0 for code in codes.values()):
        print(
            f"accel launch: {name} received; every worker of this node stopped cleanly "
            "(exit code 0).",
            file=sys.stderr,
        )
        return 0
    if err.sigval == signal.SIGINT:  # Ctrl-C: the workers got it too, from the terminal
        print(f"accel launch: stopped by {name}; the workers were stopped.", file=sys.stderr)
        return 128 + int(err.sigval)
    shown = "unknown" if not codes else ", ".join(f"{r}: {c}" for r, c in sorted(codes.items()))
    died = codes is not None and all(code == -int(err.sigval) for code in codes.values())
    advice = (
        f"they died of it: a worker holds {name} from init_distributed on, and saves at a "
        "step inside accel.preemption; one that had not reached init_distributed yet, or a "
        "script without accel.preemption, dies of it"
        if died
        else "wrap the training loop in accel.preemption to save and stop cleanly"
    )
    print(
        f"accel launch: {name} received; the workers did not all stop cleanly (local rank: "
        f"exit code, negative for a signal: {shown}); {advice}.",
        file=sys.stderr,
    )
    return 128 + int(err.sigval)
