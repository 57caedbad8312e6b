"""Run a function in several real processes, for tests of distributed code on a CPU, and catch
device mix-ups there with the device canary.

`run_world(fn, world_size=4)` starts `world_size` processes that form a gloo process group
through a TCP store the parent opened on port 0 (so parallel test runs never collide), calls
`fn(ctx, *args)` in each and returns the results in rank order. A rank that raises makes the
caller raise the same exception, with the rank's traceback attached; a world that outlives
`timeout` is killed, together with the DataLoader workers its ranks started.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from accel._canary import CANARY_DEVICE, DeviceCanary
from accel._world import RemoteTraceback, start_world
from accel.context import Parallelism

__all__ = ["RemoteTraceback", "device_canary", "run_world"]


@contextlib.contextmanager
def device_canary() -> Iterator[torch.device]:
    """Run the block with a simulated accelerator that fails device mix-ups as a GPU does.

    On a CPU every tensor is on the same device, so a tensor made on the default device meeting
    a model on `ctx.device` only fails on a GPU. Inside this block the run's device is
    `torch.device("cpu", 0)` (yielded): CPU memory and real values, but a device of its own.
    `init_distributed()`, `RunContext.single()` and `run_world` ranks pick it as they would
    pick a GPU; a tensor made without a device (or moved with `.cpu()`) is on the host, and an
    op mixing host tensors (other than 0-dim scalars) with tensors on the run's device raises
    the RuntimeError CUDA raises, as does `.numpy()` of a tensor on the run's device.
    `ACCEL_DEVICE_CANARY=1 accel launch ...` runs a whole script under it. docs/testing.md
    has the rules.

    Yields:
        The canary's device, `torch.device("cpu", 0)`.

    Example:
        >>> import accel, torch
        >>> from accel.testing import device_canary
        >>> with device_canary() as device:
        ...     ctx = accel.RunContext.single()
        ...     w = torch.ones(3, 2, device=ctx.device)
        ...     (torch.ones(4, 3, device=device) @ w).shape
        torch.Size([4, 2])
    """
    with DeviceCanary():
        yield CANARY_DEVICE


def run_world(
    fn: Callable[..., Any],
    *,
    world_size: int = 2,
    timeout: float = 60,
    args: Sequence[Any] = (),
    parallelism: Parallelism | None = None,
) -> list[Any]:
    """Call `fn(ctx, *args)` in `world_size` new processes over gloo; return their results.

    The processes start as spawned ones do (fresh modules, `fn` and `args` pickled, the
    caller's environment variables), but from a forkserver that has imported torch, the
    torch._dynamo that DDP and FSDP import, and accel once, so a world starts in milliseconds
    rather than seconds of imports per rank. `fn` must be importable (defined at module top
    level). Each rank's `ctx` is a CPU `RunContext` whose collectives time out after `timeout`
    seconds. Called inside `device_canary()`, every rank runs `fn` under the canary too, with
    the canary's device as `ctx.device`.

    Args:
        fn: the function to run on every rank.
        world_size: how many processes.
        timeout: seconds the whole world may take; then every process is killed, with the
            DataLoader workers (and any other children) the ranks started.
        args: extra positional arguments for `fn` (picklable).
        parallelism: mesh sizes; each rank's `ctx` then carries them and their `DeviceMesh`,
            as `init_distributed(parallelism=...)` gives them.

    Returns:
        The return values of `fn`, in rank order.

    Raises:
        Whatever the first failing rank raised (its traceback attached as the cause), or
        TimeoutError naming the ranks still running at the deadline; ValueError for a `fn`
        defined in a notebook cell (run it with `accel.notebook_launch`, which forks).

    Example:
        >>> from accel import gather
        >>> # def rank_values(ctx): return gather(ctx, torch.tensor([ctx.rank])).tolist()
        >>> # run_world(rank_values, world_size=2) == [[0, 1], [0, 1]]
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_world: world_size={world_size!r} must be an int >= 1.")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"run_world: timeout={timeout!r} must be a number of seconds, e.g. 60.")
    if not 0 < timeout < float("inf"):
        raise ValueError(f"run_world: timeout={timeout!r} must be a positive number of seconds.")
    if parallelism is not None:
        if not isinstance(parallelism, Parallelism):
            raise TypeError(
                f"run_world: parallelism={parallelism!r} must be an accel.Parallelism or None, "
                "e.g. parallelism=Parallelism(tp=2)."
            )
        parallelism.resolve(world_size)  # sizes that cannot fill the world fail here, once
    _check_importable("run_world", fn)
    return start_world(fn, world_size, timeout, tuple(args), parallelism)


def _check_importable(caller: str, fn: Callable[..., Any]) -> None:
    """Refuse a function a spawned process cannot import: one defined in a notebook cell or an
    interactive session, whose `__main__` the child does not have."""
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise ValueError(
            f"{caller}: fn={getattr(fn, '__qualname__', fn)!r} is defined in an interactive "
            "session (a notebook cell), which spawned processes cannot import; move it into a "
            "module, or run it with accel.notebook_launch(fn, ...), which forks."
        )
