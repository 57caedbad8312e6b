"""`accel launch` under a scheduler's stop signal: forward it to the workers, exit 0 if they do.

torchrun's agent handles the signals named by `--signals-to-handle` (PET_SIGNALS_TO_HANDLE):
its handler raises `SignalException`, the agent sends the same signal to every worker of its
node, waits for them up to TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s), kills the rest, and re-raises
(torch/distributed/elastic/agent/server/api.py, `SimpleElasticAgent.run`;
multiprocessing/api.py, `_terminate_process_handler` and `SubprocessContext._close`). Its
default list leaves out SIGUSR1 and SIGUSR2, which SLURM's `--signal` sends, so the agent would
die of them and leave the workers without the signal; accel adds them. A worker inside
`accel.preemption` stops at its next optimizer step, saves and exits 0; the launcher then
exits 0 too, instead of torch's traceback for the agent's own exception.
"""

from __future__ import annotations

import signal
import sys
from types import TracebackType
from typing import Any

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


def exit_after_signal(err: Any) -> int:
    """The launcher's exit code once the agent stopped on a signal (`SignalException`).

    0 when every worker of this node exited 0 after the signal (they saved and stopped);
    otherwise 128 + the signal number, as a shell reports a process killed by it, with one
    line (for Ctrl-C, only that the run stopped: the terminal sent it to every worker too).
    """
    name = signal.Signals(err.sigval).name
    codes = _worker_exit_codes(err.__traceback__)
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
    print(
        f"accel launch: {name} received; the workers did not all exit 0 (local rank: exit "
        f"code, negative for a signal: {shown}). Wrap the training loop in accel.preemption "
        "to save and stop cleanly.",
        file=sys.stderr,
    )
    return 128 + int(err.sigval)
