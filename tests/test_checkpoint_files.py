from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

import accel
from accel import RunContext
from accel._safetensors import manifests
from accel._safetensors.files import resolve_checkpoint
from accel._safetensors.header import CorruptFileError
from accel.checkpoint import _sharded_io


def _sharded(tmp_path: Path, weight_map: dict[str, str]) -> Path:
    for file in set(weight_map.values()):
        if "/" not in file:
            save_file({"x": torch.zeros(1)}, str(tmp_path / file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tmp_path


def test_file_index_and_folder_forms(tmp_path: Path) -> None:
    folder = _sharded(tmp_path, {"a": "model-1.safetensors", "b": "model-2.safetensors"})
    resolved = resolve_checkpoint("load", folder)
    assert [f.name for f in resolved.files] == ["model-1.safetensors", "model-2.safetensors"]
    assert (
        resolved.weight_map is not None and resolved.weight_map["b"].name == "model-2.safetensors"
    )
    single = resolve_checkpoint("load", folder / "model-1.safetensors")
    assert single.weight_map is None and single.files == (folder / "model-1.safetensors",)


@pytest.mark.parametrize("bad", ["../outside.safetensors", "/etc/passwd", "a/../../x.safetensors"])
def test_index_naming_paths_outside_its_folder_is_refused(tmp_path: Path, bad: str) -> None:
    folder = _sharded(tmp_path, {"a": bad})
    with pytest.raises(ValueError, match=r"outside the checkpoint folder"):
        resolve_checkpoint("load", folder)


def test_missing_shard_and_missing_path_and_bad_index(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(FileNotFoundError, match=r"shard 'gone.safetensors' .* is missing"):
        resolve_checkpoint("load", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        resolve_checkpoint("load", tmp_path / "nope.safetensors")
    index.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"is not a safetensors index"):
        resolve_checkpoint("load", index)
    index.unlink()
    with pytest.raises(FileNotFoundError, match=r"0 .safetensors files"):
        resolve_checkpoint("load", tmp_path)


# ------------------------------------------------------- one manifest check for every reader


def _saved_then_flipped(tmp_path: Path) -> tuple[Path, int]:
    """A save_model folder whose file has one byte flipped; the crc32 of the damaged bytes."""
    accel.save_model(RunContext.single(), nn.Linear(64, 64), tmp_path)
    path = tmp_path / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    return path, zlib.crc32(data)


def _message(err: pytest.ExceptionInfo[CorruptFileError], fn: str) -> str:
    assert type(err.value) is CorruptFileError
    return str(err.value).removeprefix(f"{fn}: ")


def test_every_reader_refuses_a_damaged_file_with_one_error_and_message(tmp_path: Path) -> None:
    path, crc = _saved_then_flipped(tmp_path)
    manifest = manifests.read_manifest("load", tmp_path)
    size, recorded = manifests.expected(manifest, path.name) or (0, 0)
    with pytest.raises(CorruptFileError) as direct:
        manifests.check_file("load", path, manifest, path.name)
    with pytest.raises(CorruptFileError) as loaded:  # checksums while it maps the file
        accel.load_checkpoint_in_model(nn.Linear(64, 64), tmp_path)
    with pytest.raises(CorruptFileError) as dispatched:  # checks every file up front
        accel.dispatch_checkpoint(nn.Linear(64, 64), tmp_path, device_map={"": "cpu"})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(CorruptFileError) as split:  # checksums split across ranks
            _sharded_io.verify("load", [path], {path: (size, recorded)})
    finally:
        dist.destroy_process_group()
    expected = (
        f"{str(path)!r} fails its checksum (size {size}, crc32 {crc:#010x}; the manifest "
        f"recorded size {size}, crc32 {recorded:#010x}); the file is corrupt, truncated or was "
        "replaced. Load an earlier checkpoint."
    )
    assert _message(direct, "load") == expected
    assert _message(loaded, "load_checkpoint_in_model") == expected
    assert _message(dispatched, "dispatch_checkpoint") == expected
    assert _message(split, "load") == expected


def test_a_truncated_file_is_refused_by_its_size_before_it_is_read(tmp_path: Path) -> None:
    accel.save_model(RunContext.single(), nn.Linear(4, 4), tmp_path)
    path = tmp_path / "model.safetensors"
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(CorruptFileError, match=rf"fails its checksum \(size {size - 4}; the "):
        accel.load_checkpoint_in_model(nn.Linear(4, 4), tmp_path)


def test_check_file_refuses_a_file_the_manifest_does_not_list_and_a_missing_one(
    tmp_path: Path,
) -> None:
    accel.save_model(RunContext.single(), nn.Linear(4, 4), tmp_path)
    manifest = manifests.read_manifest("load", tmp_path)
    manifests.check_file("load", tmp_path / "model.safetensors", manifest, "model.safetensors")
    extra = tmp_path / "extra.safetensors"
    extra.write_bytes(b"x")
    with pytest.raises(CorruptFileError, match=r"extra\.safetensors' is not listed in its folder"):
        manifests.check_file("load", extra, manifest, extra.name)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError):
        manifests.check_file("load", tmp_path / "model.safetensors", manifest, "model.safetensors")
