"""Find the largest batch size that fits in memory by shrinking it after out-of-memory errors."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar, overload

import torch

__all__ = ["find_executable_batch_size"]

P = ParamSpec("P")
R = TypeVar("R")

# Messages PyTorch uses for allocation failures that are not `torch.OutOfMemoryError`.
_OOM_MESSAGES = (
    "out of memory",
    "CUDNN_STATUS_NOT_SUPPORTED",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation failure on any device (CUDA, MPS, XPU or CPU)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _OOM_MESSAGES)


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.empty_cache()
    if torch.backends.mps.is_available():
        torch.mps.empty_cache()


@overload
def find_executable_batch_size(
    fn: Callable[Concatenate[int, P], R], *, start: int, factor: float = 0.9
) -> Callable[P, R]: ...
@overload
def find_executable_batch_size(
    fn: None = None, *, start: int, factor: float = 0.9
) -> Callable[[Callable[Concatenate[int, P], R]], Callable[P, R]]: ...
def find_executable_batch_size(fn: Any = None, *, start: int, factor: float = 0.9) -> Any:
    """Call `fn(batch_size, *args)` from `start`, shrinking the batch size after each OOM.

    After an out-of-memory error the next size is `int(batch_size * factor)`: by default 0.9,
    Accelerate's rule, so a migrated script settles on the same size (from 16 with room for 12:
    16, 14, 12). `factor=0.5` halves instead: fewer tries, a smaller size found.
    Returns a function taking the remaining arguments of `fn`. Works as a decorator too::

        @find_executable_batch_size(start=256)
        def train(batch_size: int) -> float: ...

        train()  # tries 256, then 230, 207, ... until one fits

    Errors other than out-of-memory propagate unchanged on the first try. The same rule is applied
    on every rank, so ranks whose memory differs can settle on different sizes: when the batch size
    must agree across processes, take the minimum with `accel.reduce(ctx, ..., op="min")`.

    Args:
        fn: the function to run, taking the batch size as its first argument; None to get a
            decorator.
        start: the first batch size to try, an int >= 1.
        factor: what the batch size is multiplied by (then truncated) after an
            out-of-memory error, in (0, 1); default 0.9, as in Accelerate.

    Returns:
        A function taking `fn`'s remaining arguments that returns what `fn` returns at the
        first batch size that fits; with `fn=None`, a decorator that makes such a function.

    Raises:
        ValueError: for a `start` that is not a positive integer, or a `factor` outside (0, 1).
        TypeError: for an `fn` that is not callable.
        RuntimeError: from the returned function, when even batch size 1 runs out of memory.

    Example:

    >>> from accel import find_executable_batch_size
    >>> find_executable_batch_size(lambda b: b, start=8)()
    8
    """
    if isinstance(start, bool) or not isinstance(start, int) or start < 1:
        raise ValueError(
            f"find_executable_batch_size: start={start!r} must be a positive integer, "
            "the first batch size to try."
        )
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < 1:
        raise ValueError(
            f"find_executable_batch_size: factor={factor!r} must be a number in (0, 1), what "
            "the batch size is multiplied by after an out-of-memory error; e.g. factor=0.5."
        )
    if fn is None:
        return functools.partial(find_executable_batch_size, start=start, factor=factor)
    if not callable(fn):
        raise TypeError(
            f"find_executable_batch_size: fn={fn!r} is not callable; pass the function that "
            "takes the batch size as its first argument."
        )

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        batch_size = start
        while True:
            try:
                return fn(batch_size, *args, **kwargs)
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                _free_memory()
                if int(batch_size * factor) < 1:  # batch size 1 did not fit either
                    raise RuntimeError(
                        f"find_executable_batch_size: even batch size 1 ran out of memory "
                        f"(started at {start}); the model or its inputs do not fit: reduce the "
                        "model, sequence length or precision."
                    ) from error
                batch_size = int(batch_size * factor)  # Accelerate's expression, bit for bit

    return run
