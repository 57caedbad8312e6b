"""One save in flight: staged in a hidden sibling, written by every rank (in the caller's
thread, or a background one), published by rank 0 under its final name."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from accel._groups import every_rank_step, require_group
from accel.checkpoint import _atomic, _dcp
from accel.checkpoint._state_io import classify, finish, snapshot, write_rank_files
from accel.context import RunContext

logger = logging.getLogger(__name__)

_SAVE_THREAD = "accel-checkpoint-save"


class CheckpointHandle:
    """A save in progress (or done): `wait()` blocks until it is durable and returns its path.

    On rank 0 "durable" means published under its final name; on other ranks, that this
    rank's files are written and fsynced (rank 0 publishes once every rank's are).
    """

    def __init__(self, path: Path, thread: threading.Thread | None) -> None:
        self.path = path
        self._thread = thread
        self._error: list[BaseException] = []

    def done(self) -> bool:
        """True when the save has finished (successfully or not)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path:
        """Block until the save finished; re-raise its error; return the checkpoint path."""
        if self._thread is not None:
            self._thread.join()
        if self._error:
            raise RuntimeError(f"saving {str(self.path)!r} failed") from self._error[0]
        return self.path


def _wait_for_previous_saves() -> None:
    # The next save waits for a background one, found by thread name: no global registry.
    for thread in threading.enumerate():
        if thread.name == _SAVE_THREAD and thread is not threading.current_thread():
            thread.join()


def start_save(
    fn: str,
    ctx: RunContext,
    final: Path,
    objects: dict[str, Any],
    *,
    info: dict[str, Any],
    blocking: bool,
    after_publish: Callable[[], None] | None = None,
) -> CheckpointHandle:

    plan = classify(fn, objects, pipelined=ctx.pp_size > 1)
    _wait_for_previous_saves()  # a background save of this same name may publish meanwhile
    replace = _atomic.check_target(fn, final)  # on every rank: they all refuse alike
    group = group_of(ctx, fn)
    staging = _atomic.sibling(final, "partial")
    if ctx.is_main:
        _atomic.sweep(final.parent)
    with _atomic.removed_on_failure(fn, staging, final):  # elsewhere: a name never created
        staging = _agree_on(ctx, fn, staging)  # every rank writes into the folder rank 0 made
    with _atomic.removed_on_failure(fn, staging, final):
        if plan.dcp_models:  # a collective: runs in the caller's thread, before any background
            models = dict(plan.dcp_models)
            optimizers = {n: (o, m) for n, o, m in plan.dcp_optimizers}
            flat = ctx.pp_size > 1  # stages hold different parameters: see _dcp.state_dicts
            _dcp.save(_dcp.state_dicts(models, optimizers, flat=flat), staging, group)
        files = snapshot(fn, ctx, plan, objects, copy=not blocking)
    names = sorted(n for n, _ in plan.kinds) + [n for n, _ in plan.dcp_models]
    names += [n for n, _, _ in plan.dcp_optimizers]
    info = {**info, "objects": names, "dcp": [n for n, _ in plan.dcp_models]}
    if ctx.pp_size > 1 and plan.dcp_optimizers:
        info["dcp_flat_optimizer"] = True
    timeout_s = ctx.timeout.total_seconds() if ctx.timeout is not None else 1800.0

    def job() -> None:
        # Rank 0 owns the staging folder; another rank that fails tells it (and leaves the
        # folder to it) rather than removing the folder under rank 0's feet.
        on_failure = (
            _atomic.removed_on_failure(fn, staging, final)
            if ctx.is_main
            else _atomic.reported_on_failure(fn, staging, final, ctx.rank)
        )
        with on_failure:
            write_rank_files(staging, ctx.rank, files)
            if ctx.is_main:
                finish(fn, staging, final, ctx.world_size, info, timeout_s, replace=replace)
        if ctx.is_main and after_publish is not None:
            after_publish()

    if blocking:  # every rank returns once the checkpoint is published, or every rank raises
        every_rank_step(ctx, fn, job)
        return CheckpointHandle(final, None)
    handle = CheckpointHandle(final, None)

    def run() -> None:
        try:
            job()
        except BaseException as err:
            handle._error.append(err)
            logger.error("background save of %s failed: %r", final, err)

    handle._thread = threading.Thread(target=run, name=_SAVE_THREAD, daemon=False)
    handle._thread.start()
    return handle


def _agree_on(ctx: RunContext, fn: str, staging: Path) -> Path:
    """Rank 0 creates its staging folder; every rank learns its name, or rank 0's error."""

    def create() -> str | None:
        if not ctx.is_main:
            return None
        staging.mkdir(parents=True)
        return str(staging)

    made = every_rank_step(ctx, fn, create)[0]
    assert made is not None, "rank 0 returns the folder it made"
    return Path(made)


def group_of(ctx: RunContext, fn: str) -> Any:
    return None if ctx.world_size == 1 else require_group(ctx, fn)
