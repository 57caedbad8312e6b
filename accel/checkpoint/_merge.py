"""`accel merge-weights`: a sharded (DCP) checkpoint to the Hugging Face safetensors layout.

Streamed in one process: the files' headers come from DCP's metadata (global shapes and
dtypes), then each tensor alone is read from the DCP shards (DCP reads only the byte ranges
that hold it) and written in place, so memory is bounded by the largest tensor. The output is
published as `save_model` publishes: renamed into place, with an index and a manifest.

Every byte read is verified against the checkpoint's manifest without a second read: the
reader checksums each byte range DCP asks for as it reads it, and before anything is
published the bytes it did not need (another object's state) are read once to complete each
file's crc32, which must equal the manifest's. Nothing is published from a file that fails.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
import zlib
from contextlib import suppress
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from accel._safetensors import manifests
from accel._safetensors.crc32 import combine
from accel._safetensors.exports import export_lock
from accel._safetensors.files import check_inside
from accel._safetensors.header import CorruptFileError
from accel._size import parse_size
from accel._store.exports import publish_export
from accel._store.staging import named_as, transfer_folder
from accel._store.transfer import download, listing
from accel._store.urls import Remote, locate
from accel.checkpoint import _atomic
from accel.checkpoint._dcp import DCP_DIR, _MetadataUnpickler
from accel.checkpoint._model_io import (
    FILE_METADATA,
    file_layout,
    partial_path,
    partials_removed_on_failure,
    publish_model_files,
    write_model_files,
)
from accel.checkpoint._remote import files_for_rank, read_remote_manifest
from accel.checkpoint._safetensors_io import header_bytes
from accel.checkpoint._sharded_save import presize

_FN = "merge-weights"
_METADATA = ".metadata"
_EARLIER = "Merge an earlier checkpoint, or save it again."
Sums = dict[str, tuple[int, int]]


def merge_weights(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    model: str | None = None,
    max_shard_size: int | str = "5GB",
    trust_pickle: bool = False,
) -> list[str]:
    """Write the weights of model `model` in the DCP checkpoint `src` to `dst`; return the keys.

    `src` is a `save_state` directory (its `dcp/` folder is read) or a DCP folder itself.
    `model` is the name the model was saved under; default: the only model in the checkpoint.
    Refused before anything is written: a `dst` that is, holds or lies inside the checkpoint, a
    `dst` that is a file, a checkpoint whose manifest is missing or does not list a file.
    A DeepSpeed ZeRO checkpoint (`engine.save_checkpoint`'s folder) is consolidated to fp32 by
    DeepSpeed's `zero_to_fp32`; its files are pickles, read only with `trust_pickle=True`.
    """
    max_bytes = parse_size(_FN, "max_shard_size", max_shard_size, minimum=1)
    source, destination = locate(_FN, "src", src), locate(_FN, "dst", dst)
    if isinstance(source, Remote) or isinstance(destination, Remote):
        return _merge_through_store(source, destination, model, max_bytes)
    if _is_zero_checkpoint(source):
        return _merge_zero(source, destination, max_bytes, trust_pickle=trust_pickle)
    folder = _dcp_folder(source)
    root, manifest = _manifest_of(source, folder)
    _check_overlap(source, root, destination)
    sums = _checked_files(root, folder, manifest)
    reader = _verifying_reader(folder, sums)
    metadata = reader.read_metadata()
    prefix = _model_prefix(source, metadata, manifest, model)
    tensors: dict[str, torch.Tensor] = {}
    for key, info in metadata.state_dict_metadata.items():
        if key.startswith(prefix) and hasattr(info, "size"):
            tensors[key[len(prefix) :]] = torch.empty(
                tuple(info.size), dtype=info.properties.dtype, device="meta"
            )
    if not tensors:
        raise ValueError(
            f"{_FN}: {str(src)!r} holds no tensors under {prefix!r}; pass --model with the name "
            "the model was saved under (save_state(ctx, dir, model=...) saves it as 'model')."
        )
    created = _make_destination(destination)
    layout = file_layout(tensors, max_bytes)
    try:
        with export_lock(destination):
            written = {}
            with partials_removed_on_failure(_FN, destination, [name for name, _ in layout]):
                for name, shard in layout:
                    path = partial_path(destination / name)
                    written[path] = _stream_file(reader, path, shard, prefix)
                reader.accel_verify()  # before anything is published
            publish_model_files(
                _FN, destination, tensors, {}, max_bytes, write=lambda path, **_: written[path]
            )
    except BaseException:
        for folder in created:  # the folders this call created, still empty: no debris
            with suppress(OSError):  # not empty (or gone): left as they are
                folder.rmdir()
        raise
    return list(tensors)


def _merge_through_store(
    source: Path | Remote, destination: Path | Remote, model: str | None, max_bytes: int
) -> list[str]:
    """merge-weights where SRC or DST is a URL: SRC's manifest and DCP files are downloaded
    (each checked as it lands), the merge runs locally, and DST is uploaded with its manifest
    last (`publish_export`)."""
    _check_urls_overlap(source, destination)
    with transfer_folder("download") as down, transfer_folder("upload") as up:
        local_src = source if isinstance(source, Path) else _fetch_dcp(source, down)
        local_dst = destination if isinstance(destination, Path) else up
        with named_as(down, str(source)), named_as(up, str(destination)):
            keys = merge_weights(local_src, local_dst, model=model, max_shard_size=max_bytes)
        if isinstance(destination, Remote):
            publish_export(_FN, up, destination)
    return keys


def _check_urls_overlap(source: Path | Remote, destination: Path | Remote) -> None:
    if not (isinstance(source, Remote) and isinstance(destination, Remote)):
        return
    a, b = source.path, destination.path
    if source.protocol == destination.protocol and (
        a == b or b.startswith(f"{a}/") or a.startswith(f"{b}/")
    ):
        raise ValueError(
            f"{_FN}: dst={destination.url!r} overlaps src={source.url!r} (the same prefix, "
            "inside it, or containing it); merging would write into the checkpoint. Pass a DST "
            "outside it, e.g. a sibling prefix."
        )


def _fetch_dcp(source: Remote, folder: Path) -> Path:
    """Download the DCP files of a checkpoint in a store (a `save_state` prefix, checked against
    its manifest, or a bare DCP prefix) into `folder`; return the local path to merge."""
    objects = listing(_FN, source)
    if manifests.MANIFEST in objects:
        with named_as(folder, source.url):
            manifest = read_remote_manifest(_FN, source, folder)
        dcp = {rel: e for rel, e in files_for_rank(manifest, 0).items() if rel.startswith("dcp/")}
        download(_FN, source, dcp, folder)
        return folder
    if _METADATA in objects:
        download(_FN, source, dict.fromkeys(objects), folder)
        return folder
    raise FileNotFoundError(
        f"{_FN}: src={source.url!r} is not a sharded checkpoint: it holds neither an accel "
        f"manifest nor DCP's {_METADATA}. Pass a prefix written by accel.save_state of a "
        "sharded model."
    )


def _is_zero_checkpoint(src: Path) -> bool:
    """A folder DeepSpeed's save_checkpoint wrote: `<tag>/*mp_rank_00_model_states.pt`."""
    return src.is_dir() and any(src.glob("*/*mp_rank_00_model_states.pt"))


def _merge_zero(src: Path, dst: Path, max_bytes: int, *, trust_pickle: bool) -> list[str]:
    if not trust_pickle:
        raise ValueError(
            f"{_FN}: {str(src)!r} is a DeepSpeed ZeRO checkpoint: torch.save pickles with no "
            "accel manifest, and reading them can run code stored in them. For a checkpoint you "
            "wrote, pass --trust_pickle (merge_weights(..., trust_pickle=True))."
        )
    _check_overlap(src, src, dst)
    try:  # on use: only a ZeRO checkpoint needs DeepSpeed
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as err:
        raise ImportError(
            f"{_FN}: {str(src)!r} is a DeepSpeed checkpoint, which needs DeepSpeed: "
            "`pip install deepspeed` (or `pip install -e '.[deepspeed]'` in accel's checkout)."
        ) from err
    state = get_fp32_state_dict_from_zero_checkpoint(str(src))
    write_model_files(dst, state, max_bytes)
    return list(state)


def _dcp_folder(src: Path) -> Path:
    if (src / DCP_DIR).is_dir():
        return src / DCP_DIR  # a save_state directory: its manifest must vouch for dcp/
    if (src / _METADATA).is_file():
        return src
    raise FileNotFoundError(
        f"{_FN}: src={str(src)!r} is not a sharded checkpoint: neither it nor {DCP_DIR}/ in it "
        "holds DCP's .metadata. Pass a directory written by accel.save_state of a sharded model."
    )


def _manifest_of(src: Path, folder: Path) -> tuple[Path, dict[str, Any] | None]:
    """(the checkpoint folder, its manifest); None for a bare DCP folder (no accel manifest)."""
    if folder != src:
        return src, manifests.read_manifest(_FN, src)
    if folder.name == DCP_DIR and (folder.parent / manifests.MANIFEST).is_file():
        return folder.parent, manifests.read_manifest(_FN, folder.parent)
    return folder, None


def _check_overlap(src: Path, root: Path, dst: Path) -> None:
    ours, theirs = dst.resolve(), root.resolve()
    if ours == theirs or theirs in ours.parents or ours in theirs.parents:
        raise ValueError(
            f"{_FN}: dst={str(dst)!r} overlaps the checkpoint {str(root)!r} of src={str(src)!r} "
            "(the same folder, inside it, or containing it); merging would write into the "
            "checkpoint. Pass a DST outside it, e.g. a sibling folder."
        )


def _make_destination(dst: Path) -> list[Path]:
    """Create `dst` and its missing parents; return those created, innermost first."""
    if dst.exists() and not dst.is_dir():
        raise NotADirectoryError(
            f"{_FN}: dst={str(dst)!r} is a file, not a folder. Pass a folder (created if "
            "missing) to write the safetensors files into."
        )
    missing = [p for p in (dst, *dst.parents) if not p.exists()]
    try:
        dst.mkdir(parents=True, exist_ok=True)
        return missing
    except OSError as err:
        raise OSError(
            err.errno,
            f"{_FN}: cannot create dst={str(dst)!r}: {err.strerror}. Pass a folder you can "
            "write, whose parents are folders.",
        ) from None


def _checked_files(root: Path, folder: Path, manifest: dict[str, Any] | None) -> Sums | None:
    """The manifest's (size, crc32) of each file of `folder`, by name, after checking that each
    exists, is a regular file inside the checkpoint and has its size; None with no manifest."""
    if manifest is None:
        return None
    rel_folder = folder.relative_to(root).as_posix()
    sums: Sums = {}
    for rel in manifest["files"]:
        if rel.startswith(f"{rel_folder}/"):
            name = rel[len(rel_folder) + 1 :]
            expect = manifests.expected(manifest, rel)
            assert expect is not None
            _check_file(folder / name, expect[0], root)
            sums[name] = expect
    return sums


def _check_file(path: Path, size: int | None, root: Path) -> None:
    check_inside(_FN, path, root)
    if not path.is_file():
        what = "is missing" if not path.exists() else "is not a regular file"
        raise FileNotFoundError(
            f"{_FN}: {str(path)!r} {what}, though the checkpoint lists it; the checkpoint is "
            f"incomplete. {_EARLIER}"
        )
    found = path.stat().st_size
    if size is not None and found != size:
        raise CorruptFileError(
            f"{_FN}: {str(path)!r} has {found} bytes but the manifest recorded {size}; the "
            f"file is truncated or was replaced. {_EARLIER}"
        )


def _model_prefix(
    src: Path, metadata: Any, manifest: dict[str, Any] | None, model: str | None
) -> str:
    if model is not None:
        return f"{model}."
    names = sorted({k.split(".", 1)[0] for k in metadata.state_dict_metadata})
    if manifest is not None and isinstance(manifest.get("dcp"), list):
        names = [str(n) for n in manifest["dcp"]]
    if len(names) != 1:
        raise ValueError(
            f"{_FN}: {str(src)!r} holds several objects {names}; pass --model NAME to choose "
            "the model to merge."
        )
    return f"{names[0]}."


def _verifying_reader(folder: Path, sums: Sums | None) -> Any:
    """A DCP reader that checks `.metadata` and checksums every byte range it reads."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class VerifyingReader(FileSystemReader):
        def __init__(self) -> None:
            super().__init__(folder)
            self.accel_metadata: Any = None
            self.accel_ranges: dict[str, dict[tuple[int, int], int]] = {}

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if self.accel_metadata is None:
                self.accel_metadata = _read_metadata(folder, sums)
            metadata = self.accel_metadata
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def _slice_file(self, file: Any, sinfo: Any) -> Any:
            file.seek(sinfo.offset)
            data = file.read(sinfo.length)
            if len(data) != sinfo.length:
                raise CorruptFileError(
                    f"{_FN}: {str(folder / sinfo.relative_path)!r} ends before byte "
                    f"{sinfo.offset + sinfo.length}, where DCP's metadata says a tensor lies; "
                    f"the file is truncated. {_EARLIER}"
                )
            ranges = self.accel_ranges.setdefault(sinfo.relative_path, {})
            ranges[(sinfo.offset, sinfo.length)] = zlib.crc32(data)
            return io.BytesIO(data)

        def accel_verify(self) -> None:
            """Complete each read file's crc32 with the bytes not read; compare to the manifest."""
            for name, ranges in sorted(self.accel_ranges.items()):
                if sums is not None:
                    _verify_ranges(folder / name, ranges, sums[name])

    return VerifyingReader()


def _read_metadata(folder: Path, sums: Sums | None) -> Any:
    path = folder / _METADATA
    expect = None if sums is None else sums.get(_METADATA)
    if sums is not None and expect is None:
        raise CorruptFileError(
            f"{_FN}: {str(path)!r} is not listed in the checkpoint's manifest, so it cannot be "
            f"verified. {_EARLIER}"
        )
    _check_file(path, None if expect is None else expect[0], folder)
    data = path.read_bytes()
    if expect is not None:
        manifests.check_sum(_FN, path, expect, len(data), zlib.crc32(data))
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        storage = metadata.storage_data
        state = metadata.state_dict_metadata
        if not isinstance(storage, dict) or not isinstance(state, dict):
            raise TypeError("no storage_data or state_dict_metadata")
        names = {info.relative_path for info in storage.values()}
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, ImportError, MemoryError, RecursionError) as err:  # fmt: skip
        raise CorruptFileError(
            f"{_FN}: {str(path)!r} is not DCP metadata accel can read ({type(err).__name__}: "
            f"{err}); it is truncated, damaged or not from torch.distributed.checkpoint. "
            f"{_EARLIER}"
        ) from None
    for name in sorted(names, key=str):
        relative = PurePosixPath(str(name))
        if not isinstance(name, str) or len(relative.parts) != 1 or name in (".", ".."):
            raise CorruptFileError(
                f"{_FN}: {str(path)!r} places tensors in {name!r}, not a file of the DCP "
                f"folder; refusing to read it. {_EARLIER}"
            )
        if sums is not None and name not in sums:
            raise CorruptFileError(
                f"{_FN}: {str(folder / name)!r} holds tensors but the checkpoint's manifest "
                f"does not list it, so it cannot be verified. {_EARLIER}"
            )
        _check_file(folder / name, None, folder)
    return metadata


def _verify_ranges(path: Path, ranges: dict[tuple[int, int], int], expect: tuple[int, int]) -> None:
    crc, pos = 0, 0
    with open(path, "rb") as f:
        for (offset, length), part in sorted(ranges.items()):
            if offset < pos:  # ranges that overlap: checksum the whole file instead
                crc, pos = manifests.checksum_file(path)[1], expect[0]
                break
            crc = _extend(f, crc, pos, offset)
            crc, pos = combine(crc, part, length), offset + length
        crc = _extend(f, crc, pos, expect[0])
    manifests.check_sum(_FN, path, expect, path.stat().st_size, crc)


def _extend(f: Any, crc: int, lo: int, hi: int) -> int:
    """`crc` extended with the file's bytes [lo, hi), read in 1 MiB pieces."""
    f.seek(lo)
    while lo < hi:
        piece = f.read(min(1 << 20, hi - lo))
        if not piece:
            break  # the file shrank: the crc will not match
        crc, lo = zlib.crc32(piece, crc), lo + len(piece)
    return crc


def _stream_file(
    reader: Any, path: Path, shard: dict[str, torch.Tensor], prefix: str
) -> tuple[int, int]:
    """Fill the pre-sized `path` one tensor at a time; return its (size, crc32)."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    presize(path, shard, FILE_METADATA)
    head = header_bytes(shard, FILE_METADATA)
    crc, offset = zlib.crc32(head), len(head)
    with open(path, "r+b") as f:
        for name, meta in shard.items():
            value = torch.empty(meta.shape, dtype=meta.dtype)
            _load_one(reader, prefix + name, value, dcp_load)
            flat = value.reshape(-1).view(torch.uint8)
            data = flat.numpy().data if value.numel() else memoryview(b"")
            _atomic.write_at(f.fileno(), data, offset, path)
            crc, offset = zlib.crc32(data, crc), offset + len(data)
            del value
        os.fsync(f.fileno())
    return offset, crc


def _load_one(reader: Any, key: str, value: torch.Tensor, dcp_load: Any) -> None:
    """Read one tensor; a file DCP cannot parse is named (its checksum first, when listed)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            # One plain process reading a sharded checkpoint is intended here.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load({key: value}, storage_reader=reader)
    except CheckpointException as err:
        causes = [f[0] for f in err.failures.values() if isinstance(f, tuple)]
        for cause in causes:
            if isinstance(cause, (CorruptFileError, OSError)):
                raise cause from None
        reader.accel_verify()  # names the damaged file when the manifest lists it
        raise CorruptFileError(
            f"{_FN}: reading {key!r} from {str(reader.path)!r} failed "
            f"({'; '.join(f'{type(c).__name__}: {c}' for c in causes) or err}); the checkpoint "
            f"is damaged. {_EARLIER}"
        ) from None
