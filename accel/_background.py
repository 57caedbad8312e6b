"""Checkpoint saves running in the background, and waiting for them.

There is no registry: the running saves are this process's `SaveThread`s, found by type. A save
that failed leaves a `FailedSave`, a daemon thread holding its error until someone reports it,
so that an error nobody waited for is raised by the next save or by `accel.shutdown` rather
than lost in a log (a daemon: it never keeps the process alive). Kept below checkpoint/ and
distributed.py, which both wait here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class FailedSave(threading.Thread):
    """Holds the error of a background save until `take` reports it."""

    def __init__(self, where: str, error: BaseException) -> None:
        super().__init__(name="accel-checkpoint-failed", daemon=True)
        self.where = where
        self.error = error
        self._taken = threading.Event()

    def run(self) -> None:
        self._taken.wait()

    def take(self) -> BaseException | None:
        """The error, the first time it is asked for; then None (it is reported once)."""
        if self._taken.is_set():
            return None
        self._taken.set()
        return self.error


class SaveThread(threading.Thread):
    """Runs one background save; on failure leaves a `FailedSave` with its error."""

    def __init__(self, where: str, job: Callable[[], None]) -> None:
        super().__init__(name="accel-checkpoint-save", daemon=False)
        self.where = where
        self.failed: FailedSave | None = None
        self._job = job

    def run(self) -> None:
        try:
            self._job()
        except BaseException as err:
            logger.error("background save of %s failed: %s", self.where, err)
            self.failed = FailedSave(self.where, err)
            self.failed.start()


def wait_for_saves(fn: str) -> None:
    """Wait for every background save of this process; raise the first error of one that
    failed and was not reported yet (by its handle's `wait()`, or an earlier call of this)."""
    current = threading.current_thread()
    for thread in threading.enumerate():
        if isinstance(thread, SaveThread) and thread is not current:
            thread.join()
    for thread in threading.enumerate():
        if isinstance(thread, FailedSave) and (error := thread.take()) is not None:
            raise RuntimeError(
                f"{fn}: the background save of {thread.where!r} failed: {error}"
            ) from error
