"""Whole files between a local folder and a store: several at once, retried, checked.

An upload is checked after it lands against the (size, crc32) accel keeps for the file in its
manifest: on S3 the object's own CRC32 (S3 computes it from the bytes it received, which the
client's CRC32 header already made it verify) comes back with the object's size in one HEAD;
a store that keeps no CRC32 has the object read back and checksummed. Large files go to S3 in
parts (its multipart upload, with the full-object CRC32 of the manifest at completion); the
parts of every file of a call are uploaded `parallel` at a time, by plain threads (pools of
concurrent.futures refuse work once the interpreter is shutting down, when a background save
may still be running).

Every request goes through `retries.retried`: sent again while its failure may pass, else
one line naming the URL.
"""

from __future__ import annotations

import base64
import errno
import os
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accel._safetensors.crc32 import combine, crc32
from accel._safetensors.header import CorruptFileError
from accel._safetensors.manifests import checksum_file
from accel._store.retries import no_bucket, retried, store_error
from accel._store.urls import Remote

PART = 16 << 20  # bytes per part of a multipart upload (S3: at least 5 MiB, at most 10,000)
PARALLEL = 8  # files or parts in flight at once, per process
_READ = 8 << 20  # bytes per read when an object is read back


def run_all(tasks: Sequence[Callable[[], None]], parallel: int) -> None:
    """Run `tasks` on up to `parallel` threads; stop handing out work at the first error and
    raise it once every thread has stopped."""
    lock = threading.Lock()
    todo = iter(tasks)
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                task = None if errors else next(todo, None)
            if task is None:
                return
            try:
                task()
            except BaseException as err:
                with lock:
                    errors.append(err)

    threads = [threading.Thread(target=worker, name="accel-transfer") for _ in range(parallel)]
    for t in threads[1:]:
        t.start()
    worker()
    for t in threads[1:]:
        t.join()
    if errors:
        raise errors[0]


@dataclass(frozen=True, slots=True, kw_only=True)
class Blob:
    """The bytes of one object to upload: a local file's, or pieces of memory end to end (a
    safetensors header and the tensors' own bytes, never copied whole)."""

    size: int
    """Bytes in all."""
    crc: int
    """Their crc32, as the manifest records it."""
    path: Path | None = None
    """The local file holding them, or None for `pieces`."""
    pieces: tuple[memoryview, ...] = ()
    """The bytes in memory, in order."""

    def read(self, at: int, length: int) -> bytes:
        """Bytes [at, at + length): one part of a multipart upload."""
        if self.path is not None:
            return _read(self.path, at, length)
        out, pos = [], 0
        for piece in self.pieces:
            end = pos + len(piece)
            if end > at and pos < at + length:
                out.append(piece[max(at - pos, 0) : min(at + length - pos, len(piece))])
            pos = end
            if pos >= at + length:
                break
        return b"".join(out)


def file_blob(path: Path, size: int, crc: int) -> Blob:
    """A local file to upload, of `size` bytes with crc32 `crc`."""
    return Blob(size=size, crc=crc, path=path)


def memory_blob(pieces: Sequence[memoryview]) -> Blob:
    """Pieces of memory to upload as one object; their crc32 computed here (on several
    threads for large pieces) and combined."""
    value, size = 0, 0
    for piece in pieces:
        value = combine(value, crc32(piece), len(piece))
        size += len(piece)
    return Blob(size=size, crc=value, pieces=tuple(pieces))


def _is_s3(remote: Remote) -> bool:
    return hasattr(remote.fs, "call_s3") and hasattr(remote.fs, "split_path")


def _b64(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def _read(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        return os.pread(f.fileno(), size, offset)


# --------------------------------------------------------------------------------- upload


def upload(
    fn: str,
    remote: Remote,
    files: Mapping[str, Blob],
    *,
    parallel: int | None = None,
    part: int = PART,
) -> None:
    """Upload each `rel -> Blob` to `remote/rel`, then check each landed whole (its size and
    crc32); raise one line naming the URL when one cannot be. `parallel`: files or parts in
    flight at once (default `PARALLEL`)."""
    parallel = parallel or PARALLEL
    if not _is_s3(remote):
        run_all([_generic_put(fn, remote, rel, blob, part) for rel, blob in files.items()],
                parallel)  # fmt: skip
        return
    big = {rel: blob for rel, blob in files.items() if blob.size > part}
    uploads: dict[str, str] = {}  # rel -> UploadId

    def create(rel: str) -> Callable[[], None]:
        def task() -> None:
            bucket, key, _ = remote.fs.split_path(remote.key(rel))
            made = retried(fn, remote.url_of(rel), lambda: remote.fs.call_s3(
                "create_multipart_upload", Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32",
                ChecksumType="FULL_OBJECT",
            ))  # fmt: skip
            uploads[rel] = made["UploadId"]

        return task

    try:
        run_all([create(rel) for rel in big], parallel)
        parts: dict[str, list[dict[str, Any]]] = {rel: [] for rel in big}
        tasks = []
        for rel, blob in files.items():
            if rel not in big:
                tasks.append(_put_small(fn, remote, rel, blob))
                continue
            step = _part_size(blob.size, part)
            for number, at in enumerate(range(0, blob.size, step), start=1):
                length = min(step, blob.size - at)
                tasks.append(_put_part(fn, remote, rel, uploads[rel], number, blob, at, length,
                                       parts[rel]))  # fmt: skip
        run_all(tasks, parallel)
        run_all([_complete(fn, remote, rel, uploads[rel], parts[rel], files[rel]) for rel in big],
                parallel)  # fmt: skip
        uploads.clear()
    finally:
        for rel, upload_id in uploads.items():  # a failed upload leaves no parts to pay for
            _abort(remote, rel, upload_id)


def _part_size(size: int, part: int) -> int:
    return max(part, -(-size // 10_000))  # S3 takes at most 10,000 parts


def _put_small(fn: str, remote: Remote, rel: str, blob: Blob) -> Callable[[], None]:
    def task() -> None:
        bucket, key, _ = remote.fs.split_path(remote.key(rel))
        data = blob.read(0, blob.size)
        retried(fn, remote.url_of(rel), lambda: remote.fs.call_s3(
            "put_object", Bucket=bucket, Key=key, Body=data, ChecksumAlgorithm="CRC32"
        ))  # fmt: skip
        check_object(fn, remote, rel, blob.size, blob.crc)

    return task


def _put_part(
    fn: str,
    remote: Remote,
    rel: str,
    upload_id: str,
    number: int,
    blob: Blob,
    at: int,
    length: int,
    done: list[dict[str, Any]],
) -> Callable[[], None]:
    def task() -> None:
        bucket, key, _ = remote.fs.split_path(remote.key(rel))
        data = blob.read(at, length)
        sent = retried(fn, remote.url_of(rel), lambda: remote.fs.call_s3(
            "upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
            Body=data, ChecksumAlgorithm="CRC32",
        ))  # fmt: skip
        entry = {"PartNumber": number, "ETag": sent["ETag"]}
        if sent.get("ChecksumCRC32"):
            entry["ChecksumCRC32"] = sent["ChecksumCRC32"]
        done.append(entry)  # list.append is atomic: threads of one file share the list

    return task


def _complete(
    fn: str,
    remote: Remote,
    rel: str,
    upload_id: str,
    parts: list[dict[str, Any]],
    blob: Blob,
) -> Callable[[], None]:
    def task() -> None:
        bucket, key, _ = remote.fs.split_path(remote.key(rel))
        listed = sorted(parts, key=lambda p: int(p["PartNumber"]))
        # The store checks the whole object's CRC32 against the manifest's (S3: BadDigest).
        retried(fn, remote.url_of(rel), lambda: remote.fs.call_s3(
            "complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
            MultipartUpload={"Parts": listed}, ChecksumCRC32=_b64(blob.crc),
            ChecksumType="FULL_OBJECT",
        ))  # fmt: skip
        check_object(fn, remote, rel, blob.size, blob.crc)

    return task


def _abort(remote: Remote, rel: str, upload_id: str) -> None:
    bucket, key, _ = remote.fs.split_path(remote.key(rel))
    try:
        remote.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
    except Exception:  # best effort: the error being raised is the one that matters
        return


def _generic_put(fn: str, remote: Remote, rel: str, blob: Blob, part: int) -> Callable[[], None]:
    def put() -> None:
        if blob.path is not None:
            remote.fs.put_file(str(blob.path), remote.key(rel))
            return
        with remote.fs.open(remote.key(rel), "wb") as f:  # streamed, a part at a time
            for at in range(0, blob.size, part):
                f.write(blob.read(at, min(part, blob.size - at)))

    def task() -> None:
        retried(fn, remote.url_of(rel), put)
        check_object(fn, remote, rel, blob.size, blob.crc)

    return task


def check_object(fn: str, remote: Remote, rel: str, size: int, crc: int) -> None:
    """Refuse `remote/rel` unless the store holds `size` bytes whose crc32 is `crc`."""
    url, key = remote.url_of(rel), remote.key(rel)
    found_crc: int | None = None
    if _is_s3(remote):
        bucket, object_key, _ = remote.fs.split_path(key)
        head = retried(fn, url, lambda: remote.fs.call_s3(
            "head_object", Bucket=bucket, Key=object_key, ChecksumMode="ENABLED"
        ))  # fmt: skip
        found_size = int(head["ContentLength"])
        stored = head.get("ChecksumCRC32")
        if stored and head.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT":
            found_crc = int.from_bytes(base64.b64decode(stored), "big")
    else:
        remote.fs.invalidate_cache(key)
        found_size = int(retried(fn, url, lambda: remote.fs.info(key))["size"])
    if found_size == size and found_crc is None:
        found_crc = retried(fn, url, lambda: _crc_of_object(remote, key))
    if (found_size, found_crc) != (size, crc):
        raise CorruptFileError(
            f"{fn}: {url!r} holds {found_size} bytes with crc32 {found_crc or 0:#010x} after "
            f"its upload, not the {size} bytes with crc32 {crc:#010x} written; the upload was "
            "damaged on its way. Save again."
        )


def _crc_of_object(remote: Remote, key: str) -> int:
    value = 0
    with remote.fs.open(key, "rb") as f:
        while chunk := f.read(_READ):
            value = zlib.crc32(chunk, value)
    return value


# --------------------------------------------------------------------------------- small files


def put_bytes(fn: str, remote: Remote, rel: str, data: bytes, *, check: bool = True) -> None:
    """Write a small object (a manifest, a marker); with `check`, verify it as `upload` does."""
    url, key = remote.url_of(rel), remote.key(rel)
    if _is_s3(remote):
        bucket, object_key, _ = remote.fs.split_path(key)
        retried(fn, url, lambda: remote.fs.call_s3(
            "put_object", Bucket=bucket, Key=object_key, Body=data, ChecksumAlgorithm="CRC32"
        ))  # fmt: skip
    else:
        retried(fn, url, lambda: remote.fs.pipe_file(key, data))
    if check:
        check_object(fn, remote, rel, len(data), zlib.crc32(data))


def get_bytes(fn: str, remote: Remote, rel: str) -> bytes | None:
    """A small object's bytes, or None when there is no such object."""
    url, key = remote.url_of(rel), remote.key(rel)
    try:
        data: bytes = retried(fn, url, lambda: remote.fs.cat_file(key))
    except FileNotFoundError as err:
        if no_bucket(err):
            raise
        return None
    return data


def require_bucket(fn: str, remote: Remote) -> None:
    """Raise the one-line missing-bucket error when the URL's bucket does not exist.

    Asked after an empty listing (every save and `latest_checkpoint` list first), not after
    each missing object, which rank 0's polling of the records meets often. s3fs says a bucket
    is missing in its error, but gcsfs answers a missing bucket as it answers a missing object
    (a 404 naming the request's path), so a `latest_checkpoint` of a mistyped gs:// bucket would
    read as a run with no checkpoint yet. Stores without buckets (memory://) are not asked.
    """
    split = getattr(remote.fs, "split_path", None)
    if split is None:
        return
    bucket = split(remote.path)[0]
    if not retried(fn, remote.url, lambda: remote.fs.exists(bucket)):
        missing = FileNotFoundError(errno.ENOENT, "the specified bucket does not exist")
        raise store_error(fn, remote.url, missing)


def listing(fn: str, remote: Remote) -> dict[str, int]:
    """Every object below `remote`, as relative path -> size ({} for an empty prefix)."""
    remote.fs.invalidate_cache()  # all of it: s3fs drops a path's parents, not its children
    try:
        found = retried(fn, remote.url, lambda: remote.fs.find(remote.path, detail=True))
    except FileNotFoundError as err:
        if no_bucket(err):
            raise
        found = {}
    prefix = remote.path + "/"
    files = {
        key[len(prefix) :]: int(info.get("size") or 0)
        for key, info in found.items()
        if key.startswith(prefix) and info.get("type", "file") == "file"
    }
    if not files:
        require_bucket(fn, remote)
    return files


def remove(fn: str, remote: Remote, rels: Sequence[str]) -> None:
    """Delete the objects `rels` below `remote` (those already gone are no error)."""
    keys = [remote.key(rel) for rel in rels]
    if not keys:
        return
    if _is_s3(remote):  # one request per 1,000 keys
        retried(fn, remote.url, lambda: remote.fs.rm(keys))
    else:
        for key in keys:
            try:
                retried(fn, remote.url, lambda key=key: remote.fs.rm_file(key))  # type: ignore[misc]
            except FileNotFoundError:
                continue
    remote.fs.invalidate_cache(remote.path)


# --------------------------------------------------------------------------------- download


def download(
    fn: str,
    remote: Remote,
    files: Mapping[str, tuple[int, int] | None],
    folder: Path,
    *,
    parallel: int = PARALLEL,
) -> None:
    """Download each `rel` of `remote` into `folder/rel`, checking it against its expected
    (size, crc32) when given; raise one line naming the URL when one fails."""

    def fetch(rel: str, expect: tuple[int, int] | None) -> Callable[[], None]:
        def task() -> None:
            local = folder / rel
            local.parent.mkdir(parents=True, exist_ok=True)
            url = remote.url_of(rel)
            try:
                retried(fn, url, lambda: remote.fs.get_file(remote.key(rel), str(local)))
            except FileNotFoundError as err:
                if no_bucket(err):
                    raise
                raise FileNotFoundError(
                    errno.ENOENT,
                    f"{fn}: {url!r} is missing, though the checkpoint's manifest lists it; the "
                    "checkpoint is incomplete. Load an earlier checkpoint",
                ) from None
            if expect is not None:
                size, crc = checksum_file(local)
                if (size, crc) != expect:
                    raise CorruptFileError(
                        f"{fn}: {url!r} fails its checksum (size {size}, crc32 {crc:#010x}; the "
                        f"manifest recorded size {expect[0]}, crc32 {expect[1]:#010x}); the "
                        "object is corrupt, truncated or was replaced. Load an earlier "
                        "checkpoint."
                    )

        return task

    run_all([fetch(rel, expect) for rel, expect in files.items()], parallel)
