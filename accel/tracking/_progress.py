"""`progress`: a tqdm bar on the main process, a silent one with the same methods elsewhere."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import IO, Any, TypeVar

from typing_extensions import Self

from accel.context import RunContext

T = TypeVar("T")


class _SilentBar(Iterable[T]):
    """A progress bar that draws nothing, with tqdm's methods (used when tqdm is not installed)."""

    def __init__(self, iterable: Iterable[T], total: int | None = None) -> None:
        self.iterable = iterable
        self.total = total if total is not None else _length(iterable)
        self.n = 0

    def __iter__(self) -> Iterator[T]:
        for item in self.iterable:
            yield item
            self.n += 1

    def __len__(self) -> int:
        if self.total is None:
            raise TypeError(f"progress: {type(self.iterable).__name__} has no len(); pass total=")
        return self.total

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        self.n += int(n)

    def reset(self, total: int | None = None) -> None:
        self.n, self.total = 0, total if total is not None else self.total

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None: ...
    def set_description_str(self, desc: str | None = None, refresh: bool = True) -> None: ...
    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kw: Any) -> None: ...
    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None: ...
    def refresh(self) -> None: ...
    def clear(self) -> None: ...
    def close(self) -> None: ...


def _length(iterable: Iterable[Any]) -> int | None:
    try:
        return len(iterable)  # type: ignore[arg-type]
    except TypeError:
        return None


def progress(
    ctx: RunContext,
    iterable: Iterable[T],
    *,
    desc: str | None = None,
    total: float | None = None,
    leave: bool = True,
    unit: str = "it",
    file: IO[str] | None = None,
    mininterval: float = 0.1,
    disable: bool = False,
) -> Any:
    """Show a tqdm progress bar over `iterable` on the main process; a silent one elsewhere.

    Every rank gets a bar with tqdm's methods (`update`, `set_postfix`, `set_description`,
    `close`, use as a context manager), so a loop ported from Accelerate that calls
    `bar.update(1)` runs unchanged on every rank; only the main process draws. Without tqdm
    every rank gets a silent bar and the main process warns once per call.

    Args:
        ctx: the run context; only `ctx.is_main` shows a bar.
        iterable: what to iterate over (a loader, a range, ...).
        desc: the bar's label.
        total: the number of items, when `iterable` has no `len()`.
        leave: keep the finished bar on screen.
        unit: the name of one item.
        file: where the bar is written (tqdm's default, stderr, when None).
        mininterval: the least seconds between two redraws.
        disable: show no bar (and still iterate).

    Returns:
        A tqdm bar wrapping `iterable` (disabled on other ranks), or a silent bar with the
        same methods when tqdm is not installed.

    Example:
        >>> from accel import RunContext, progress
        >>> ctx = RunContext(rank=1, world_size=2)
        >>> bar = progress(ctx, range(4), desc="steps")
        >>> sum(bar), bar.update(1)
        (6, None)
    """
    try:
        from tqdm import tqdm  # optional dependency
    except ImportError:
        if ctx.is_main:
            warnings.warn(
                "progress: tqdm is not installed, so no progress bar is shown; install it with "
                "`pip install tqdm` (or `pip install -e '.[tqdm]'` in accel's checkout).",
                stacklevel=2,
            )
        return _SilentBar(iterable, None if total is None else int(total))
    return tqdm(
        iterable,
        desc=desc,
        total=total,
        leave=leave,
        unit=unit,
        file=file,
        mininterval=mininterval,
        disable=disable or not ctx.is_main,
    )
