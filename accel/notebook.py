"""Run a function defined in a notebook on several processes (Accelerate's `notebook_launcher`).

A function written in a notebook cell lives in the kernel's `__main__`, which a spawned process
(`run_world`, torchrun) cannot import; forked processes inherit it. `notebook_launch` forks one
process per rank and otherwise is `accel.testing.run_world`: the same store on a free port, the
same hard deadline that kills every rank, the first rank's exception re-raised in the notebook
with its traceback attached, and the results returned in rank order.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any, Literal

import torch

from accel._world import start_world
from accel.context import Parallelism

__all__ = ["notebook_launch"]


def notebook_launch(
    fn: Callable[..., Any],
    *args: Any,
    num_processes: int = 2,
    device: Literal["cpu", "cuda"] | None = None,
    timeout: float = 600.0,
    parallelism: Parallelism | None = None,
) -> list[Any]:
    """Call `fn(ctx, *args)` in `num_processes` forked processes; return their results.

    Each rank's `ctx` is a `RunContext` with its process group made (gloo on CPU, NCCL with one
    GPU per rank), so `fn` uses accel as a script under `accel launch` would, minus
    `init_distributed`. CUDA must not be initialised in the notebook before the launch (a
    forked process cannot use it): build models and tensors on the GPU inside `fn`.

    Args:
        fn: the training function, defined in a cell; called as `fn(ctx, *args)`.
        *args: its other arguments (not pickled: the children inherit them).
        num_processes: how many processes (ranks); at most the number of GPUs on "cuda".
        device: "cpu" or "cuda"; None takes "cuda" where a GPU is visible, else "cpu".
        timeout: seconds the whole launch may take; then every rank is killed, with the
            processes it started.
        parallelism: mesh sizes; each `ctx` then carries them and their `DeviceMesh`.

    Returns:
        The return values of `fn` (picklable), in rank order.

    Raises:
        RuntimeError: when CUDA was initialised in this process before the launch.
        ValueError: for a bad `num_processes`, `device` or `timeout`, or more processes than
            GPUs.
        TimeoutError: naming the ranks still running at the deadline.
        Exception: whatever the first failing rank raised, its traceback as the cause.

    Example:
        >>> # in a cell:   def train(ctx, lr): ... return loss
        >>> # next cell:   accel.notebook_launch(train, 0.1, num_processes=2)
        >>> # -> [loss on rank 0, loss on rank 1]
    """
    chosen = _check(fn, num_processes, device, timeout)
    # The ranks are forked, so they inherit the modules this process has. DDP's constructor
    # imports torch._dynamo (with torch.distributed.fsdp: over 800 modules, about 1.5 s of CPU
    # per process); imported here once per kernel, no rank of this or a later launch pays it.
    importlib.import_module("torch._dynamo")
    return start_world(
        fn, num_processes, float(timeout), args, parallelism,
        start_method="fork", device_type=chosen, caller="notebook_launch",
    )  # fmt: skip


def _check(fn: Callable[..., Any], num_processes: int, device: str | None, timeout: float) -> str:
    if not callable(fn):
        raise TypeError(f"notebook_launch: fn={fn!r} is not callable; pass the function itself.")
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(
            f"notebook_launch: num_processes={num_processes!r} must be an int >= 1, e.g. "
            "num_processes=2."
        )
    bad_timeout = isinstance(timeout, bool) or not isinstance(timeout, (int, float))
    if bad_timeout or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(
            f"notebook_launch: timeout={timeout!r} must be a positive number of seconds, e.g. "
            "timeout=600."
        )
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        raise RuntimeError(
            "notebook_launch: CUDA is already initialised in this process, and a forked process "
            "cannot use it. Restart the kernel and keep every CUDA call (model.cuda(), "
            "torch.cuda.*, tensors on the GPU) inside the launched function."
        )
    # device_count() asks NVML where it can, which does not initialise CUDA here.
    num_gpus = torch.cuda.device_count()
    chosen = device if device is not None else ("cuda" if num_gpus > 0 else "cpu")
    if chosen not in ("cpu", "cuda"):
        raise ValueError(
            f"notebook_launch: device={device!r} is not supported; expected 'cpu', 'cuda' or "
            "None (a GPU where one is visible)."
        )
    if chosen == "cuda" and num_processes > num_gpus:
        raise ValueError(
            f"notebook_launch: num_processes={num_processes} needs one GPU each but "
            f"{num_gpus} are visible; pass num_processes<={num_gpus} or device='cpu'."
        )
    return chosen
