"""Rank-aware logging: records from rank 0 only unless asked, each prefixed with its rank."""

from __future__ import annotations

import logging
import warnings
from collections.abc import MutableMapping
from typing import Any, cast

from accel.context import RunContext

__all__ = ["RankLogger", "get_logger"]


class RankLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A logger adapter that drops records on non-main ranks unless `main_process_only=False`.

    Every logging call takes `main_process_only` (default True); records carry `[rank r]`.
    """

    def __init__(self, logger: logging.Logger, *, rank: int, world_size: int) -> None:
        # Plain ints, not the context: a logger may be pickled into DataLoader workers.
        super().__init__(logger, {"rank": rank})
        self.rank = rank
        self.world_size = world_size

    def log(  # type: ignore[override]
        self, level: int, msg: object, *args: Any, main_process_only: bool = True, **kwargs: Any
    ) -> None:
        if main_process_only and self.rank != 0:
            return
        if self.isEnabledFor(level):
            text, options = self.process(msg, kwargs)
            self.logger.log(level, text, *args, **options)

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        prefix = f"[rank {self.rank}] " if self.world_size > 1 else ""
        return f"{prefix}{msg}", kwargs

    def debug(self, msg: object, *args: Any, **kwargs: Any) -> None:
        self.log(logging.DEBUG, msg, *args, **kwargs)

    def info(self, msg: object, *args: Any, **kwargs: Any) -> None:
        self.log(logging.INFO, msg, *args, **kwargs)

    def warning(self, msg: object, *args: Any, **kwargs: Any) -> None:
        self.log(logging.WARNING, msg, *args, **kwargs)

    def error(self, msg: object, *args: Any, **kwargs: Any) -> None:
        self.log(logging.ERROR, msg, *args, **kwargs)

    def critical(self, msg: object, *args: Any, **kwargs: Any) -> None:
        self.log(logging.CRITICAL, msg, *args, **kwargs)


def get_logger(ctx: RunContext, name: str) -> RankLogger:
    """Return a logger whose records come from rank 0 only, unless `main_process_only=False`.

    accel adds no handlers; configure output with `logging.basicConfig` as usual. The context
    comes first, as everywhere in accel; the old order `get_logger(name, ctx)` still works and
    warns (DeprecationWarning).

    Args:
        ctx: the run context; its rank decides which records are kept.
        name: the name of the standard logger to wrap, as for `logging.getLogger`.

    Returns:
        A `RankLogger`: each logging call takes `main_process_only` (default True), and with
        `world_size > 1` messages start with `[rank r]`.

    Example:
        >>> from accel import get_logger, RunContext
        >>> log = get_logger(RunContext(rank=1, world_size=2), "train")
        >>> log.info("only rank 0 prints this")
        >>> log.warning("every rank prints this", main_process_only=False)
    """
    first, second = cast(Any, ctx), cast(Any, name)  # the old order arrives swapped
    if isinstance(first, str) and isinstance(second, RunContext):
        warnings.warn(
            f"get_logger: get_logger(name, ctx) is deprecated; pass the context first: "
            f"get_logger(ctx, {first!r}).",
            DeprecationWarning,
            stacklevel=2,
        )
        first, second = second, first
    if not isinstance(first, RunContext):
        raise TypeError(
            f"get_logger: ctx={first!r} is not a RunContext; call get_logger(ctx, name), e.g. "
            "get_logger(ctx, __name__)."
        )
    if not isinstance(second, str):
        raise TypeError(
            f"get_logger: name={second!r} is not a str; pass the logger's name, e.g. "
            "get_logger(ctx, __name__)."
        )
    return RankLogger(logging.getLogger(second), rank=first.rank, world_size=first.world_size)
