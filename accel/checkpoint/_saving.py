"""One save in flight, written by every rank (in the caller's thread, or a background one).

A local save is staged in a hidden sibling and published by rank 0 under its final name; a save
to a store is staged in each rank's local temporary folder, uploaded under the final prefix and
committed by rank 0's manifest (`_remote`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from accel._background import SaveThread, wait_for_saves
from accel._groups import every_rank_step, require_group
from accel._safetensors.manifests import checksum_file
from accel._store.staging import new_folder
from accel._store.staging import remove as remove_folder
from accel._store.transfer import Blob, file_blob, memory_blob, upload
from accel._store.urls import Location, Remote
from accel.checkpoint import _atomic, _dcp, _remote
from accel.checkpoint._safetensors_io import as_bytes, header_bytes
from accel.checkpoint._state_io import (
    Files,
    classify,
    finish,
    snapshot,
    write_rank_files,
)
from accel.context import RunContext

logger = logging.getLogger(__name__)


class CheckpointHandle:
    """A save in progress (or done): `wait()` blocks until it is durable and returns its path.

    On rank 0 "durable" means published under its final name (committed by its manifest, in a
    store); on other ranks, that this rank's files are written (uploaded and checked) and rank 0
    can publish once every rank's are. The path is a `Path`, or the URL (a str) of a save to a
    store.
    """

    def __init__(self, path: Path | str, thread: SaveThread | None) -> None:
        self.path = path
        self._thread = thread

    def done(self) -> bool:
        """True when the save has finished (successfully or not)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path | str:
        """Block until the save finished; re-raise its error; return the checkpoint path."""
        if self._thread is not None:
            self._thread.join()
            failed = self._thread.failed
            if failed is not None and (error := failed.take()) is not None:
                raise RuntimeError(f"saving {str(self.path)!r} failed: {error}") from error
        return self.path


def start_save(
    fn: str,
    ctx: RunContext,
    final: Location,
    objects: dict[str, Any],
    *,
    info: dict[str, Any],
    blocking: bool,
    after_publish: Callable[[], None] | None = None,
    numbered: bool = False,
) -> CheckpointHandle:
    plan = classify(fn, objects, pipelined=ctx.pp_size > 1)
    group_of(ctx, fn)  # a several-rank context without its process group is refused first
    wait_for_saves(fn)  # a background save of this same name may publish meanwhile
    names = sorted(n for n, _ in plan.kinds) + [n for n, _ in plan.dcp_models]
    names += [n for n, _, _ in plan.dcp_optimizers]
    info = {**info, "objects": names, "dcp": [n for n, _ in plan.dcp_models]}
    if ctx.pp_size > 1 and plan.dcp_optimizers:
        info["dcp_flat_optimizer"] = True
    timeout_s = ctx.timeout.total_seconds() if ctx.timeout is not None else 1800.0
    if isinstance(final, Remote):
        job = _remote_job(fn, ctx, final, plan, objects, info, timeout_s, blocking, numbered)
    else:
        job = _local_job(fn, ctx, final, plan, objects, info, timeout_s, blocking)

    def run() -> None:
        job()
        if ctx.is_main and after_publish is not None:
            after_publish()

    if blocking:  # every rank returns once the checkpoint is published, or every rank raises
        every_rank_step(ctx, fn, run)
        return CheckpointHandle(_shown(final), None)
    thread = SaveThread(str(final), run)
    thread.start()
    return CheckpointHandle(_shown(final), thread)


def _shown(final: Location) -> Path | str:
    return final.url if isinstance(final, Remote) else final


def _dcp_and_snapshot(
    fn: str, ctx: RunContext, plan: Any, objects: dict[str, Any], staging: Path, blocking: bool
) -> Files:
    """In the caller's thread: the sharded objects through DCP (a collective, so before any
    background work) into `staging`, and this rank's other files copied off the objects."""
    if plan.dcp_models:
        models = dict(plan.dcp_models)
        optimizers = {n: (o, m) for n, o, m in plan.dcp_optimizers}
        flat = ctx.pp_size > 1  # stages hold different parameters: see _dcp.state_dicts
        _dcp.save(_dcp.state_dicts(models, optimizers, flat=flat), staging, group_of(ctx, fn))
    return snapshot(fn, ctx, plan, objects, copy=not blocking)


def _local_job(
    fn: str,
    ctx: RunContext,
    final: Path,
    plan: Any,
    objects: dict[str, Any],
    info: dict[str, Any],
    timeout_s: float,
    blocking: bool,
) -> Callable[[], None]:
    replace = _atomic.check_target(fn, final)  # on every rank: they all refuse alike
    staging = _atomic.sibling(final, "partial")
    if ctx.is_main:
        _atomic.sweep(final.parent)
    with _atomic.removed_on_failure(fn, staging, final):  # elsewhere: a name never created
        staging = _agree_on(ctx, fn, staging)  # every rank writes into the folder rank 0 made
    with _atomic.removed_on_failure(fn, staging, final):
        files = _dcp_and_snapshot(fn, ctx, plan, objects, staging, blocking)

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

    return job


def _remote_job(
    fn: str,
    ctx: RunContext,
    final: Remote,
    plan: Any,
    objects: dict[str, Any],
    info: dict[str, Any],
    timeout_s: float,
    blocking: bool,
    numbered: bool,
) -> Callable[[], None]:
    def check() -> list[str] | None:  # rank 0 sweeps and checks; every rank learns the outcome
        if not ctx.is_main:
            return None
        if numbered:  # what killed saves and rotations left in the other steps of the root
            _remote.sweep_steps(fn, final.parent)
        return _remote.check_target(fn, final)

    replaced = every_rank_step(ctx, fn, check)[0]
    staging = new_folder("upload")
    try:
        files = _dcp_and_snapshot(fn, ctx, plan, objects, staging, blocking)
        dcp = sorted(p for p in (staging / _dcp.DCP_DIR).rglob("*") if p.is_file())
        rels = [f"{stem}.{ext}" for stem in files for ext in ("json", "safetensors")]
        rels += [p.relative_to(staging).as_posix() for p in dcp]
        # The first write to the store, on every rank and before any background work: a
        # missing bucket or a denied request is raised here, on every rank, in one line.
        every_rank_step(ctx, fn, lambda: _remote.announce(fn, final, ctx.rank, rels))
    except BaseException:
        remove_folder(staging)
        raise

    def job() -> None:
        try:
            blobs = file_blobs(files)  # uploaded from memory; DCP's files from the staging
            for path in dcp:
                blobs[path.relative_to(staging).as_posix()] = file_blob(path, *checksum_file(path))
            if ctx.is_main and replaced is not None:
                _remote.uncommit(fn, final, replaced)
            upload(fn, final, blobs)
            entries = {rel: [blob.size, blob.crc] for rel, blob in blobs.items()}
            _remote.finish_rank(fn, final, ctx.rank, entries)
        except BaseException as err:
            _remote.report_failure(fn, final, ctx.rank, err)
            raise
        finally:
            remove_folder(staging)
        if ctx.is_main:
            _remote.commit(fn, final, ctx.world_size, info, timeout_s, replaced)

    return job


def file_blobs(files: Files) -> dict[str, Blob]:
    """The objects a save to a store uploads for `files`, straight from memory: each
    `<stem>.safetensors` is the header and the tensors' own bytes, as `write_rank_files` writes
    them, with no local file in between."""
    blobs = {}
    for stem, (tensors, skeleton) in files.items():
        blobs[f"{stem}.json"] = memory_blob([memoryview(skeleton)])
        pieces = [memoryview(header_bytes(tensors, None)), *map(as_bytes, tensors.values())]
        blobs[f"{stem}.safetensors"] = memory_blob([p for p in pieces if len(p)])
    return blobs


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
