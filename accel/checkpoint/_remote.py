"""Checkpoints in an object store (a `Remote`): written without rename, committed by a manifest.

A store cannot rename a folder, so a checkpoint cannot appear under its name in one step as a
local one does. Its files go straight under the checkpoint's prefix instead, and the manifest,
written last, is the commit:

1. each rank writes its files into a local staging folder (in the temporary folder, not
   fsynced: the store's copy is the durable one) and records under the prefix which files it
   is about to upload (`.accel-rank<r>.json`: {"writing": [...]});
2. it uploads them, several at once, each checked after upload (size and crc32), then replaces
   its record with {"done": {rel: [size, crc32]}} (or {"failed": ...});
3. rank 0, once every rank's record says done, writes `accel-manifest.json`: from that instant
   the checkpoint exists. Then it removes the records.

Readers take a prefix only with a manifest whose files are all there with their sizes, and check
each file's crc32 as they download it. A save killed before its manifest leaves a prefix with no
manifest: never picked, and swept by the next save, which deletes exactly the files the records
name (nothing else under a prefix is accel's to delete). Replacing a committed checkpoint of the
same name first uncommits it (`.accel-replaced.json` names its files, then its manifest is
deleted), so a save killed midway leaves that name with no committed checkpoint; numbered
checkpoints are each saved once. Deleting one (rotation) records its files
(`.accel-deleting.json`), deletes its manifest, then the files.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from accel._groups import describe, reported
from accel._safetensors.manifests import MANIFEST, read_manifest
from accel._store.staging import named_as, transfer_folder
from accel._store.transfer import download, get_bytes, listing, put_bytes, remove
from accel._store.urls import Remote
from accel.checkpoint import _atomic
from accel.checkpoint._state_io import load

REPLACED = ".accel-replaced.json"
DELETING = ".accel-deleting.json"
_RECORD = re.compile(r"\.accel-(rank\d+|replaced|deleting)\.json")
_STEP = re.compile(r"step-(\d+)")
_PER_RANK = re.compile(r"(?:^|/)(?:grads-)?rank(\d+)\.(?:json|safetensors)")


def record(rank: int) -> str:
    """The name of rank `rank`'s record of a save in progress."""
    return f".accel-rank{rank}.json"


def _recorded(fn: str, prefix: Remote, objects: dict[str, int]) -> tuple[set[str], set[str]]:
    """(the files accel's records under `prefix` name, the records themselves)."""
    files: set[str] = set()
    records = {rel for rel in objects if _RECORD.fullmatch(rel)}
    for rel in records:
        data = get_bytes(fn, prefix, rel)
        try:
            doc = json.loads(data or b"{}")
        except ValueError:
            continue  # a record is written whole; one that is not JSON names nothing
        files.update(doc.get("writing", ()), doc.get("done", {}), doc.get("files", ()))
    return files, records


def check_target(fn: str, target: Remote) -> list[str] | None:
    """Rank 0, before a save: sweep what a killed save left under `target`, refuse a prefix
    holding files that are not accel's, and return the files of the committed checkpoint the
    save replaces (None when there is none)."""
    objects = listing(fn, target)
    if not objects:
        return None
    committed: set[str] = set()
    if MANIFEST in objects:
        manifest = json.loads(get_bytes(fn, target, MANIFEST) or b'{"files": {}}')
        committed = {MANIFEST, *manifest.get("files", {})}
    recorded, records = _recorded(fn, target, objects)
    foreign = sorted(set(objects) - committed - recorded - records)
    if foreign:
        raise FileExistsError(
            f"{fn}: directory={target.url!r} holds objects that are not an accel checkpoint's; "
            f"saving would mix with them: {foreign[:5]}"
            f"{f' and {len(foreign) - 5} more' if len(foreign) > 5 else ''}. Pass a new or "
            "empty prefix, or remove those objects first."
        )
    if not committed:  # what a killed save (or deletion) left: its own files, named by records
        remove(fn, target, sorted((recorded & set(objects)) | records))
        return None
    return sorted(committed - {MANIFEST})


def sweep_steps(fn: str, root: Remote) -> None:
    """Rank 0, before a numbered save: remove what killed saves and rotations left in `root`:
    the recorded files of each `step-<n>` with no manifest, and stray records of committed ones.
    Other objects are never touched."""
    for step, objects in _steps(listing(fn, root)).items():
        prefix = root.child(f"step-{step}")
        if MANIFEST in objects:
            strays = sorted(rel for rel in objects if rel.startswith(".accel-rank"))
            remove(fn, prefix, strays)
        elif any(_RECORD.fullmatch(rel) for rel in objects):
            recorded, records = _recorded(fn, prefix, objects)
            remove(fn, prefix, sorted((recorded & set(objects)) | records))


def _steps(objects: dict[str, int]) -> dict[int, dict[str, int]]:
    steps: dict[int, dict[str, int]] = {}
    for rel, size in objects.items():
        head, _, rest = rel.partition("/")
        match = _STEP.fullmatch(head)
        if match and rest:
            steps.setdefault(int(match[1]), {})[rest] = size
    return steps


def committed_steps(
    fn: str, root: Remote, *, newest_only: bool = False
) -> list[tuple[int, Remote, dict[str, Any]]]:
    """The committed `step-<n>` checkpoints of `root` as (n, prefix, manifest), oldest first:
    a manifest, and every file it lists present with its size. `newest_only`: stop at the
    newest one (one manifest read when it is whole).

    A writer may commit step n+1 and rotate step n away between the listing and the reads: a
    listed manifest that is gone when read makes the listing stale, and it is taken again.
    """
    found: list[tuple[int, Remote, dict[str, Any]]] = []
    for _ in range(_RESCANS):
        found, stale = _scan(fn, root, newest_only)
        if not stale:
            break
        time.sleep(0.05)
    return sorted(found, key=lambda item: item[0])


_RESCANS = 20


def _scan(
    fn: str, root: Remote, newest_only: bool
) -> tuple[list[tuple[int, Remote, dict[str, Any]]], bool]:
    found: list[tuple[int, Remote, dict[str, Any]]] = []
    for step, objects in sorted(_steps(listing(fn, root)).items(), reverse=True):
        if MANIFEST not in objects:
            continue
        prefix = root.child(f"step-{step}")
        data = get_bytes(fn, prefix, MANIFEST)
        if data is None:
            return found, True  # deleted since the listing
        manifest = _parsed(data) or {}
        files = manifest.get("files")
        if not isinstance(files, dict) or any(
            objects.get(rel) != entry[0] for rel, entry in files.items()
        ):
            continue  # damaged, or its files deleted meanwhile: not a checkpoint to load
        found.append((step, prefix, manifest))
        if newest_only:
            break
    return found, False


def _parsed(data: bytes | None) -> dict[str, Any] | None:
    try:
        doc = json.loads(data) if data is not None else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def rotate(fn: str, root: Remote, keep: int, step: int) -> None:
    """Delete the committed checkpoints of `root` but the newest `keep` (never `step`)."""
    for old, prefix, manifest in committed_steps(fn, root)[:-keep]:
        if old != step:
            delete(fn, prefix, sorted(manifest["files"]))


def delete(fn: str, prefix: Remote, files: list[str]) -> None:
    """Delete a committed checkpoint: record its files, uncommit it, then delete them."""
    put_bytes(fn, prefix, DELETING, json.dumps({"files": files}).encode(), check=False)
    remove(fn, prefix, [MANIFEST])
    remove(fn, prefix, [*files, DELETING])


def uncommit(fn: str, target: Remote, files: list[str]) -> None:
    """Before a save replaces the committed checkpoint `target` (of `files`): record its files
    (deleted after the new commit, or by the sweep of a save that follows a kill), then delete
    its manifest, so that no reader takes a mix of old and new files as a checkpoint."""
    put_bytes(fn, target, REPLACED, json.dumps({"files": files}).encode(), check=False)
    remove(fn, target, [MANIFEST])


def announce(fn: str, target: Remote, rank: int, rels: list[str]) -> None:
    """Record the files this rank is about to upload (the first write of a save, on every rank:
    a missing bucket or a denied request is found here, before anything is uploaded)."""
    put_bytes(fn, target, record(rank), json.dumps({"writing": sorted(rels)}).encode(), check=False)


def finish_rank(fn: str, target: Remote, rank: int, entries: dict[str, list[int]]) -> None:
    """Tell rank 0 this rank's files are uploaded and checked."""
    put_bytes(fn, target, record(rank), json.dumps({"done": entries}).encode(), check=False)


def report_failure(fn: str, target: Remote, rank: int, err: BaseException) -> None:
    """Leave this rank's error where rank 0 waits for its record (best effort)."""
    code, text = describe(err)
    doc = {"writing": [], "failed": {"errno": code, "error": text}}
    try:
        put_bytes(fn, target, record(rank), json.dumps(doc).encode(), check=False)
    except OSError:
        return  # the store is unreachable: rank 0 times out on this rank, naming it


def commit(
    fn: str,
    target: Remote,
    world_size: int,
    info: dict[str, Any],
    timeout_s: float,
    replaced: list[str] | None,
) -> None:
    """Rank 0: wait until every rank's record says done, write the manifest (the commit), then
    remove the records and the replaced checkpoint's files the new one does not overwrite."""
    entries = _wait_for_records(fn, target, world_size, timeout_s)
    manifest = _atomic.manifest_bytes(entries, {"world_size": world_size, **info})
    put_bytes(fn, target, MANIFEST, manifest)
    stale = sorted(set(replaced or ()) - set(entries))
    remove(fn, target, [*stale, *(record(r) for r in range(world_size)), REPLACED])


def _wait_for_records(
    fn: str, target: Remote, world_size: int, timeout_s: float
) -> dict[str, list[int]]:
    entries: dict[str, list[int]] = {}
    pending = list(range(world_size))
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while pending:
        for rank in list(pending):
            doc = _parsed(get_bytes(fn, target, record(rank))) or {}
            if "failed" in doc:
                failure = doc["failed"]
                raise reported(f"rank {rank}: {failure['error']}", int(failure["errno"]))
            if "done" in doc:
                entries.update(doc["done"])
                pending.remove(rank)
        if not pending:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{fn}: ranks {pending} did not finish uploading to {target.url!r} within "
                f"{timeout_s:.0f}s; a rank died or cannot reach the store."
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.5)
    return entries


def files_for_rank(manifest: dict[str, Any], rank: int) -> dict[str, tuple[int, int]]:
    """The files of a state checkpoint rank `rank` reads: all but other ranks' own files."""
    out = {}
    for rel, (size, crc) in manifest["files"].items():
        match = _PER_RANK.search(rel)
        if match is None or int(match[1]) == rank:
            out[rel] = (int(size), int(crc))
    return out


def read_remote_manifest(fn: str, target: Remote, folder: Path) -> dict[str, Any]:
    """Download `target`'s manifest into `folder` and return it, checked as a local one is."""
    data = get_bytes(fn, target, MANIFEST)
    if data is None:
        raise FileNotFoundError(
            f"{fn}: {target.url!r} has no {MANIFEST}, so it is not a committed accel "
            "checkpoint (a save was interrupted, or it was written by something else). Use "
            "accel.latest_checkpoint(root) to find the newest committed one."
        )
    (folder / MANIFEST).write_bytes(data)
    with named_as(folder, target.url):
        return read_manifest(fn, folder)


def load_remote(
    fn: str, ctx: Any, target: Remote, objects: dict[str, Any], group: Any
) -> dict[str, Any]:
    """`load_state` of a checkpoint in a store: this rank's files downloaded (each checked
    against the manifest as it lands) into a local folder, loaded from there, then removed."""
    with transfer_folder("download") as folder:
        manifest = read_remote_manifest(fn, target, folder)
        download(fn, target, files_for_rank(manifest, ctx.rank), folder)
        with named_as(folder, target.url):
            return load(fn, ctx, folder, objects, group)
