"""DeepSpeed's C++ op, built ahead of the engine and never by two processes at once.

Imported only when DeepSpeed is used: it imports deepspeed.
"""

from __future__ import annotations

import fcntl
import time
from pathlib import Path
from typing import Any

_OP = "ShareMemCommBuilder"  # DeepSpeed's CPU shared-memory comm op, built at engine start


def import_deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError as err:
        raise ImportError(
            "wrap_model: strategy='deepspeed' needs DeepSpeed: `pip install deepspeed` (or "
            "`pip install -e '.[deepspeed]'` in accel's checkout)."
        ) from err
    return deepspeed


def build_ops(*, remove_stale_lock: bool) -> float:
    """Build DeepSpeed's CPU comm op under a file lock; see `build_deepspeed_ops`."""
    import_deepspeed()
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory

    start = time.perf_counter()
    builder = get_accelerator().create_op_builder(_OP)
    if builder is None or not builder.is_compatible(verbose=False):
        return time.perf_counter() - start  # not a CPU run: nothing is built at start
    folder = Path(_get_build_directory(builder.NAME, verbose=False))
    guard = folder.parent / f"{folder.name}.accel-build.lock"
    with open(guard, "a") as handle:  # accel's own lock: released by the kernel if killed
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = folder / "lock"  # torch's FileBaton; every accel build holds the guard
            if stale.exists():
                if not remove_stale_lock:
                    raise RuntimeError(
                        f"DeepSpeed op build: {stale} is left from a killed build, and "
                        "every build would wait on it forever. Remove it (rm "
                        f"{stale}, or make deepspeed-ops), then run again."
                    )
                stale.unlink()
            builder.load(verbose=False)
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
    return time.perf_counter() - start
