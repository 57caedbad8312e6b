"""How `accel launch` runs the script in each worker: as `python script.py` (or `python -m`)
would, but an uncaught exception is also written down for the launcher.

torchrun's agent learns only exit codes, and when it noticed them (to the second), so when one
rank raises and the others then fail in a collective, its "Root Cause" often names a rank that
only failed because of the first. Here the exception is written, in torch's own error-file
format, to the file the agent gives each worker (`$TORCHELASTIC_ERROR_FILE`), with the time to
the nanosecond; `accel launch` then names the rank that raised first. A fatal signal (a C++
abort, a segfault) prints each thread's Python stack (`faulthandler`) before the worker dies.
Stdlib only: nothing is imported before the script that the script itself would not import,
except under `ACCEL_DEVICE_CANARY=1`, which runs the script inside
`accel.testing.device_canary()`.

At exit, after the script's own exit hooks, a script that imported `torch.distributed` gets
accel's gloo drain (`accel._exit`): a group accel never saw (Accelerate's, transformers'
Trainer's, the script's own `init_process_group`) could otherwise abort the finished worker.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import runpy
import sys
import time
import traceback
from collections.abc import Sequence
from types import TracebackType

_OWN_FILES = (os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>")


def record(err: BaseException, path: str | None) -> None:
    """Write `err` where torchrun's agent reads a worker's error (nothing when `path` is None)."""
    if not path:
        return
    summary = f"{type(err).__name__}: {err}".strip().splitlines()[0]
    data = {
        "message": {
            "message": summary,
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(err)),
                "timestamp": str(int(time.time())),
            },
        },
        "accel": {"time_ns": time.time_ns(), "summary": summary},
    }
    try:
        with open(path, "w") as file:
            json.dump(data, file)
    except OSError as err:  # the script's own exception matters more; say why it is unrecorded
        print(f"accel launch: could not record the error in {path}: {err}", file=sys.stderr)


def _script_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the script's first frame on (this runner's and runpy's dropped)."""
    while tb is not None and tb.tb_frame.f_code.co_filename in _OWN_FILES:
        tb = tb.tb_next
    return tb


def _canary(value: str) -> contextlib.AbstractContextManager[object]:
    """The device canary when `ACCEL_DEVICE_CANARY` asks for it (tests on a CPU)."""
    if value.strip().lower() in ("", "0", "false", "no"):
        return contextlib.nullcontext()
    if value.strip().lower() not in ("1", "true", "yes"):
        raise ValueError(
            f"accel launch: ACCEL_DEVICE_CANARY={value!r} must be 1 or 0; set "
            "ACCEL_DEVICE_CANARY=1 to run the script under the device canary, or unset it."
        )
    from accel.testing import device_canary  # only here: the plain runner imports nothing

    return device_canary()


def _drain_gloo_at_exit() -> None:
    """Let gloo's worker threads finish releasing tensors before the interpreter finalizes.

    accel registers the same drain with any group it creates or uses; a script that made its
    group without accel (Accelerate's state, transformers' Trainer) has none, and a gloo thread
    freeing the last collective's tensor during finalization ends the worker with SIGABRT
    ("terminate called without an active exception"), as `accel._exit` explains. accel is
    imported only here, at exit, and only when the script imported torch.distributed itself.
    """
    if "torch.distributed" not in sys.modules:
        return
    from accel._exit import drain_gloo_workers  # at exit only: the runner imports no accel

    drain_gloo_workers()


def run(argv: Sequence[str]) -> None:
    """Run `script args...`, or `-m module args...`, as the worker's main program."""
    # A worker killed by a fatal signal (SIGABRT from C++, SIGSEGV) writes no Python traceback
    # and no error file: the agent learns only the signal. Have it print every thread's Python
    # stack first, so the launcher's output names the frame. The signal still ends the worker.
    faulthandler.enable(all_threads=True)
    atexit.register(_drain_gloo_at_exit)  # first registered: it runs after the script's hooks
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    try:
        with _canary(os.environ.get("ACCEL_DEVICE_CANARY", "")):
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                script = os.path.abspath(argv[0])  # as `python script.py` gives it
                sys.argv = [script, *argv[1:]]
                sys.path[0] = os.path.dirname(script)
                runpy.run_path(script, run_name="__main__")
    except SystemExit as err:
        if err.code not in (None, 0):
            record(err, error_file)
        raise
    except KeyboardInterrupt:
        # Ctrl-C reaches the launcher and every worker at once: the launcher says so in one
        # line, so a worker leaves without its traceback, with the shell's code for SIGINT.
        raise SystemExit(130) from None
    except BaseException as err:
        record(err, error_file)
        tb = _script_frames(err.__traceback__)
        sys.excepthook(type(err), err.with_traceback(tb), tb)
        raise SystemExit(1) from None


if __name__ == "__main__":
    run(sys.argv[1:])
