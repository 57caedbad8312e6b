"""Play one rank of the fake world in a child process told its rank as a launcher tells it.

DeepSpeed's engine reads its local rank from the `LOCAL_RANK` environment variable (which
torchrun and DeepSpeed's launcher set), and accel does not write its own process's
environment. So for a DeepSpeed layout the estimate does what a launcher does: it starts a
child Python process with the rank's launcher variables in its environment, sends it the rank
to play (pickled: the model's builder and the batch, loss and optimizer callables must be
importable functions, not lambdas), and reads back the rank's usage or its error.
"""

from __future__ import annotations

import os
import pickle
import runpy
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from types import MappingProxyType
from typing import Any

from accel.estimate import _plan
from accel.estimate._spec import StepSpec, Usage

# The errors an estimate reports in one line; any other comes back as a RuntimeError.
_REPORTED = MappingProxyType(
    {e.__name__: e for e in (ValueError, NotImplementedError, TypeError, ImportError)}
)


def estimate_in_child(layout: _plan.Layout, rank: int, spec: StepSpec, *, round_to: int) -> Usage:
    """`_plan.estimate_rank` in a child process whose environment names the rank."""
    try:
        job = pickle.dumps((layout, rank, spec, round_to))  # unpickled once __main__ is there
        payload = pickle.dumps((sys.path, _main_file(), job))
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        raise ValueError(
            "estimate_memory: under DeepSpeed each rank is estimated in a child process (its "
            "engine reads LOCAL_RANK from the environment), which receives the model's "
            f"builder, batch, loss and optimizer by import, and one cannot be sent ({err}); "
            "pass module-level functions (or 'package.module:callable'), not lambdas."
        ) from err
    local = layout.local_world_size
    env = os.environ | {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % local),
        "WORLD_SIZE": str(layout.world_size),
        "LOCAL_WORLD_SIZE": str(local),
    }
    with tempfile.TemporaryDirectory(prefix="accel-estimate-") as folder:
        answer = Path(folder) / "answer.pickle"
        done = subprocess.run(
            [sys.executable, "-m", "accel.estimate._child", str(answer)],
            input=payload,
            env=env,
            capture_output=True,
            check=False,
        )
        if not answer.is_file():
            tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["nothing"]
            raise RuntimeError(
                f"estimate_memory: the child process estimating rank {rank} exited with "
                f"{done.returncode} and no answer; its last line: {tail[0]}"
            )
        kind, value = pickle.loads(answer.read_bytes())
    if kind == "usage":
        return value  # type: ignore[no-any-return]
    raise _REPORTED.get(kind, RuntimeError)(value)


def _main_file() -> str | None:
    """The script the parent runs as __main__ (its functions are pickled by that name)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return path if path and getattr(main, "__spec__", None) is None else None


def _load_main(path: str) -> None:
    """Run the parent's script as "__mp_main__" (its `if __name__ == "__main__":` part does not
    run) and let it stand for __main__, as multiprocessing's spawn does."""
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(runpy.run_path(path, run_name="__mp_main__"))
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def _main(answer: str) -> None:
    result: tuple[str, Any]
    try:
        path, main_file, job = pickle.loads(sys.stdin.buffer.read())
        sys.path[:] = path
        if main_file is not None:
            _load_main(main_file)
        layout, rank, spec, round_to = pickle.loads(job)
        result = ("usage", _plan.estimate_rank(layout, rank, spec, round_to=round_to))
    except Exception as err:  # sent back to the parent, which raises it there
        result = (type(err).__name__, str(err))
    Path(answer).write_bytes(pickle.dumps(result))


if __name__ == "__main__":
    _main(sys.argv[1])
