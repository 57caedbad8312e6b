"""Checkpoints given the wrong paths and damaged or hostile files: refused, naming the file.

Nothing here may delete a user's file, change an object from a checkpoint that fails its
checks, or answer with a raw traceback that does not name the file.
"""

from __future__ import annotations

import json
import logging
import re
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import accel
from accel import RunContext

CTX = RunContext.single()
MANIFEST = "accel-manifest.json"


def _mlp(seed: int, width: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, width), nn.ReLU(), nn.Linear(width, 2))


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.state_dict().values()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _flip_byte(path: Path, from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[-from_end] ^= 0x01
    path.write_bytes(bytes(data))


def _rewrite(directory: Path, rel: str, data: bytes) -> None:
    """Replace a file and its manifest entry, as a hostile writer that knows the format would."""
    (directory / rel).write_bytes(data)
    manifest = json.loads((directory / MANIFEST).read_text())
    manifest["files"][rel] = [len(data), zlib.crc32(data)]
    (directory / MANIFEST).write_text(json.dumps(manifest))


# ------------------------------------------------------------------------ item 1: paths


def test_save_state_refuses_a_folder_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"'.*out'.*precious\.txt"):
        accel.save_state(CTX, out, model=_mlp(0))
    assert (out / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging left
    accel.save_state(CTX, tmp_path / "empty", model=_mlp(0))  # a new folder is fine


def test_save_state_replaces_its_own_checkpoint(tmp_path: Path) -> None:
    accel.save_state(CTX, tmp_path / "s", model=_mlp(0))
    accel.save_state(CTX, tmp_path / "s", model=_mlp(1))
    model = _mlp(5)
    accel.load_state(CTX, tmp_path / "s", model=model)
    assert _same(_params(model), _params(_mlp(1)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_save_state_on_a_file_refuses_before_touching_it(tmp_path: Path) -> None:
    path = tmp_path / "weights"
    path.write_bytes(b"the user's file")
    with pytest.raises(NotADirectoryError, match=re.escape(str(path)) + r".*is a file"):
        accel.save_state(CTX, path, model=_mlp(0))
    with pytest.raises(NotADirectoryError, match=re.escape(str(path)) + r".*is a file"):
        accel.save_checkpoint(CTX, path, {"model": _mlp(0)}, step=1)
    assert path.read_bytes() == b"the user's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights"]


def test_load_state_and_latest_checkpoint_say_the_path_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "weights"
    path.write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match=re.escape(str(path)) + r".*is a file"):
        accel.load_state(CTX, path, model=_mlp(0))
    with pytest.raises(NotADirectoryError, match=re.escape(str(path)) + r".*is a file"):
        accel.latest_checkpoint(path)


# ------------------------------------------------------------------------ item 4: all or nothing


@pytest.mark.parametrize("corrupt", ["optimizer.safetensors", "rng/rank0.safetensors"])
def test_load_state_changes_nothing_when_any_file_is_corrupt(tmp_path: Path, corrupt: str) -> None:
    model = _mlp(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    accel.save_state(CTX, tmp_path / "s", model=model, optimizer=opt)
    _flip_byte(tmp_path / "s" / corrupt, 3)
    fresh = _mlp(7)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    before, opt_before = _params(fresh), fresh_opt.state_dict()
    torch.manual_seed(11)
    expected_rand = torch.rand(3)
    torch.manual_seed(11)
    with pytest.raises(ValueError, match=re.escape(corrupt) + r".*fails its checksum"):
        accel.load_state(CTX, tmp_path / "s", model=fresh, optimizer=fresh_opt)
    assert _same(_params(fresh), before), "the model was overwritten by a failed load"
    assert fresh_opt.state_dict() == opt_before
    assert torch.equal(torch.rand(3), expected_rand)  # the RNG state was not replaced


# ------------------------------------------------------------------------ item 5: headers


def _raw_safetensors(header: bytes, data: bytes = b"", length: int | None = None) -> bytes:
    n = len(header) if length is None else length
    return struct.pack("<Q", n) + header + data


def _entry(shape: list[Any], offsets: list[Any], dtype: str = "F32") -> bytes:
    weight = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
    return json.dumps({"weight": weight}).encode()


# Each case: the damaged file's bytes and a word its error must contain.
HOSTILE: dict[str, tuple[bytes, str]] = {
    "negative_shape": (_raw_safetensors(_entry([-4, -4], [0, 64]), bytes(64)), "shape"),
    "deep_nesting": (_raw_safetensors(b'{"a":' * 50_000 + b"1" + b"}" * 50_000), "nested"),
    "huge_header_length": (_raw_safetensors(b"{}", length=(1 << 63) + 5), "header"),
    "not_utf8": (_raw_safetensors(b'{"\xff\xfe": 1}   '), "UTF-8"),
    "truncated_json": (_raw_safetensors(b'{"weight": {"dtype"'), "JSON"),
    "unknown_dtype": (_raw_safetensors(_entry([4, 4], [0, 64], "F99"), bytes(64)), "dtype"),
    "offsets_past_the_end": (_raw_safetensors(_entry([4, 4], [0, 64]), bytes(16)), "offsets"),
    "offsets_not_ints": (_raw_safetensors(_entry([4, 4], ["0", 1e300]), bytes(64)), "offsets"),
    "too_short": (b"\x01\x00", "bytes"),
}


def _linear() -> nn.Module:
    return nn.Linear(4, 4, bias=False)


def _load_weights(path: Path) -> None:
    accel.load_checkpoint_in_model(_linear(), path)


def _dispatch(path: Path) -> None:
    with accel.init_empty_weights():
        model = _linear()
    accel.dispatch_checkpoint(model, path, device_map={"": "cpu"})


WEIGHT_LOADERS: dict[str, Callable[[Path], None]] = {
    "load_checkpoint_in_model": _load_weights,
    "dispatch_checkpoint": _dispatch,
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
@pytest.mark.parametrize("loader", sorted(WEIGHT_LOADERS))
def test_damaged_safetensors_is_refused_naming_the_file(
    tmp_path: Path, loader: str, case: str
) -> None:
    data, word = HOSTILE[case]
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=re.escape(str(path))) as info:
        WEIGHT_LOADERS[loader](tmp_path)
    assert word.lower() in str(info.value).lower(), str(info.value)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_load_state_refuses_a_damaged_header_even_with_a_matching_manifest(
    tmp_path: Path, case: str
) -> None:
    model = _linear()
    accel.save_state(CTX, tmp_path / "s", model=model)
    _rewrite(tmp_path / "s", "model.safetensors", HOSTILE[case][0])
    target = tmp_path / "s" / "model.safetensors"
    with pytest.raises(ValueError, match=re.escape(str(target))) as info:
        accel.load_state(CTX, tmp_path / "s", model=_linear())
    assert HOSTILE[case][1].lower() in str(info.value).lower(), str(info.value)


@pytest.mark.parametrize("loader", sorted(WEIGHT_LOADERS))
def test_a_shard_linked_to_a_large_file_outside_is_refused_before_it_is_read(
    tmp_path: Path, loader: str
) -> None:
    outside = tmp_path / "system" / "disk.img"
    outside.parent.mkdir()
    with open(outside, "wb") as f:  # a 4 GiB sparse file that starts like an ELF binary
        f.write(b"\x7fELF\x02\x01\x01\x00")
        f.truncate(4 << 30)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(outside)
    with pytest.raises(ValueError, match=r"model\.safetensors.*symbolic link to .*disk\.img"):
        WEIGHT_LOADERS[loader](folder)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt"])
@pytest.mark.parametrize("loader", sorted(WEIGHT_LOADERS))
@pytest.mark.parametrize("as_folder", [False, True])
def test_a_pickle_checkpoint_is_named_with_the_conversion(
    tmp_path: Path, loader: str, name: str, as_folder: bool
) -> None:
    path = tmp_path / name
    torch.save(_linear().state_dict(), path)
    with pytest.raises(ValueError, match=re.escape(str(path)) + r".*pickle.*safetensors"):
        WEIGHT_LOADERS[loader](tmp_path if as_folder else path)


def test_dispatch_checkpoint_verifies_the_accel_manifest(tmp_path: Path) -> None:
    accel.save_model(CTX, _linear(), tmp_path)
    _dispatch(tmp_path)  # intact: loads
    _flip_byte(tmp_path / "model.safetensors", 5)  # a bit of the weights, not the header
    with pytest.raises(ValueError, match=r"model\.safetensors.*fails its checksum"):
        _dispatch(tmp_path)


def test_plain_safetensors_without_manifest_still_loads_everywhere(tmp_path: Path) -> None:
    weights = _linear().state_dict()
    save_file(weights, str(tmp_path / "model.safetensors"))
    model = _linear()
    accel.load_checkpoint_in_model(model, tmp_path)
    assert torch.equal(model.weight, weights["weight"])
    _dispatch(tmp_path)


# ------------------------------------------------------------------------ item 6: stale shards


def test_save_model_resaved_in_another_layout_leaves_no_stale_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")  # the user's (or transformers') own file
    (tmp_path / "model-00001-of-00002.safetensors.bak").write_text("user backup")
    accel.save_model(CTX, _mlp(0, width=64), tmp_path, max_shard_size=700)  # 3 shards
    assert (tmp_path / "model.safetensors.index.json").is_file()
    small = _mlp(1, width=64)
    accel.save_model(CTX, small, tmp_path)  # now one file
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [MANIFEST, "config.json", "model-00001-of-00002.safetensors.bak",
                     "model.safetensors"]  # fmt: skip
    loaded = _mlp(2, width=64)
    accel.load_checkpoint_in_model(loaded, tmp_path)
    assert _same(_params(loaded), _params(small))
    accel.save_model(CTX, _mlp(3, width=64), tmp_path, max_shard_size=700)  # sharded again
    assert not (tmp_path / "model.safetensors").exists()
    assert (tmp_path / "config.json").read_text() == "{}"
    loaded = _mlp(2, width=64)
    accel.load_checkpoint_in_model(loaded, tmp_path)
    assert _same(_params(loaded), _params(_mlp(3, width=64)))


# ------------------------------------------------------------------------ item 7: bad neighbours


@pytest.mark.parametrize("entry", [["x", 3], 5, None, [1]])
def test_latest_checkpoint_skips_a_neighbour_with_a_bad_manifest(
    tmp_path: Path, entry: Any, caplog: pytest.LogCaptureFixture
) -> None:
    accel.save_checkpoint(CTX, tmp_path, {"model": _mlp(0)}, step=1)
    accel.save_checkpoint(CTX, tmp_path, {"model": _mlp(0)}, step=2)
    manifest = json.loads((tmp_path / "step-2" / MANIFEST).read_text())
    manifest["files"]["model.json"] = entry
    (tmp_path / "step-2" / MANIFEST).write_text(json.dumps(manifest))
    with caplog.at_level(logging.DEBUG, logger="accel"):
        assert accel.latest_checkpoint(tmp_path) == tmp_path / "step-1"
    assert "step-2" in caplog.text
    with pytest.raises(ValueError, match=r"step-2.*accel-manifest\.json"):
        accel.load_state(CTX, tmp_path / "step-2", model=_mlp(0))


@pytest.mark.parametrize("doc", [{"kind": "module"}, [1, 2], {"state": {"__tensor__": 5}}])
def test_load_state_names_a_state_file_that_lacks_its_structure(tmp_path: Path, doc: Any) -> None:
    accel.save_state(CTX, tmp_path / "s", model=_mlp(0))
    _rewrite(tmp_path / "s", "model.json", json.dumps(doc).encode())
    with pytest.raises(ValueError, match=r"model\.json"):
        accel.load_state(CTX, tmp_path / "s", model=_mlp(0))


def test_saving_a_step_again_right_after_a_background_save_of_it_replaces_it(
    tmp_path: Path,
) -> None:
    big = nn.Linear(1024, 1024)  # 4 MB: the background write is still running at the next call
    first = accel.save_checkpoint(CTX, tmp_path, {"model": big}, step=1, blocking=False)
    with torch.no_grad():
        big.weight.fill_(3.0)
    accel.save_checkpoint(CTX, tmp_path, {"model": big}, step=1)
    assert first.wait() == tmp_path / "step-1"
    loaded = nn.Linear(1024, 1024)
    accel.load_state(CTX, tmp_path / "step-1", model=loaded)
    assert bool((loaded.weight == 3.0).all())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]


def test_save_state_will_not_replace_a_folder_holding_files_its_manifest_does_not_list(
    tmp_path: Path,
) -> None:
    # save_model writes a manifest beside the user's own files (config, tokenizer): that folder
    # is not a training-state checkpoint to replace wholesale.
    (tmp_path / "config.json").write_text("{}")
    accel.save_model(CTX, _mlp(0), tmp_path)
    with pytest.raises(FileExistsError, match=r"does not list; .*config\.json"):
        accel.save_state(CTX, tmp_path, model=_mlp(1))
    assert (tmp_path / "config.json").read_text() == "{}"
    assert (tmp_path / "model.safetensors").is_file()


@pytest.mark.parametrize("name", ["model.safetensors.index.json", MANIFEST])
@pytest.mark.parametrize(
    "data", [b'{"a":' * 50_000 + b"1" + b"}" * 50_000, b'{"\xff": 1}', b"[1, 2"]
)
def test_a_damaged_index_or_manifest_is_named(tmp_path: Path, name: str, data: bytes) -> None:
    accel.save_model(CTX, _mlp(0, width=64), tmp_path, max_shard_size=700)  # sharded: an index
    (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError, match=re.escape(name)):
        accel.load_checkpoint_in_model(_mlp(0, width=64), tmp_path)
    with pytest.raises(ValueError, match=re.escape(name)):
        _dispatch_mlp(tmp_path)


def _dispatch_mlp(path: Path) -> None:
    with accel.init_empty_weights():
        model = _mlp(0, width=64)
    accel.dispatch_checkpoint(model, path, device_map={"": "cpu"})


# ------------------------------------------------------------ shards linked from outside


def _two_tensors() -> nn.Module:
    return nn.Linear(4, 4)  # weight and bias: two shards at max_shard_size=64


def _load_two(path: Path) -> None:
    accel.load_checkpoint_in_model(_two_tensors(), path)


def _dispatch_two(path: Path) -> None:
    with accel.init_empty_weights():
        model = _two_tensors()
    accel.dispatch_checkpoint(model, path, device_map={"": "cpu"})


LOADERS_TWO: dict[str, Callable[[Path], None]] = {
    "load_checkpoint_in_model": _load_two,
    "dispatch_checkpoint": _dispatch_two,
}


def _linked_out(tmp_path: Path, sharded: bool) -> tuple[Path, Path, Path]:
    """A save_model export whose (first) shard was moved out and linked back: same bytes."""
    folder = tmp_path / "ckpt"
    accel.save_model(CTX, _two_tensors(), folder, max_shard_size=64 if sharded else "5GB")
    name = "model-00001-of-00002.safetensors" if sharded else "model.safetensors"
    outside = tmp_path / "elsewhere" / name
    outside.parent.mkdir()
    (folder / name).rename(outside)
    (folder / name).symlink_to(outside)
    return folder, folder / name, outside


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("loader", sorted(LOADERS_TWO))
def test_a_shard_linked_from_outside_the_folder_is_refused_naming_link_and_target(
    tmp_path: Path, loader: str, sharded: bool
) -> None:
    folder, link, outside = _linked_out(tmp_path, sharded)
    pattern = re.escape(str(link)) + ".*symbolic link to " + re.escape(repr(str(outside)))
    with pytest.raises(ValueError, match=pattern):
        LOADERS_TWO[loader](folder)
    if sharded:  # the same through the index
        with pytest.raises(ValueError, match=pattern):
            LOADERS_TWO[loader](folder / "model.safetensors.index.json")


def test_load_state_refuses_a_file_linked_from_outside_naming_link_and_target(
    tmp_path: Path,
) -> None:
    accel.save_state(CTX, tmp_path / "s", model=_linear())
    link, outside = tmp_path / "s" / "model.safetensors", tmp_path / "elsewhere.safetensors"
    link.rename(outside)
    link.symlink_to(outside)
    model = _linear()
    before = _params(model)
    pattern = re.escape(str(link)) + ".*symbolic link to " + re.escape(repr(str(outside)))
    with pytest.raises(ValueError, match=pattern):
        accel.load_state(CTX, tmp_path / "s", model=model)
    assert _same(_params(model), before)


@pytest.mark.parametrize("loader", sorted(LOADERS_TWO))
def test_links_inside_the_folder_and_the_hub_cache_layout_still_load(
    tmp_path: Path, loader: str
) -> None:
    # Hugging Face's cache: snapshots/<rev>/<file> -> ../../blobs/<sha>, a link out of the
    # snapshot folder that loaders must keep following.
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    accel.save_model(CTX, _two_tensors(), tmp_path / "export", max_shard_size=64)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, path in enumerate(sorted((tmp_path / "export").iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        path.rename(blob)
        (snapshot / path.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    LOADERS_TWO[loader](snapshot)
    inside = tmp_path / "inside"  # a link to a file of the same folder
    accel.save_model(CTX, _two_tensors(), inside, max_shard_size=64)
    shard = inside / "model-00002-of-00002.safetensors"
    shard.rename(inside / "real.bin")
    shard.symlink_to("real.bin")
    LOADERS_TWO[loader](inside)


def test_an_accelerate_folder_names_the_loader_of_each_of_its_files(tmp_path: Path) -> None:
    """Issue 44 item 10: the message sent scheduler.bin to optimizer.load_state_dict."""
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=4)
    save_file(model.state_dict(), tmp_path / "model.safetensors")
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.bin")  # as Accelerate writes them
    torch.save(scheduler.state_dict(), tmp_path / "scheduler.bin")
    (tmp_path / "random_states_0.pkl").write_bytes(b"")
    with pytest.raises(FileNotFoundError) as caught:
        accel.load_state(CTX, tmp_path, model=model)
    message = str(caught.value)
    objects = {"optimizer": optimizer, "scheduler": scheduler, "torch": torch}
    for name in ("optimizer", "scheduler"):
        path = str(tmp_path / f"{name}.bin")
        call = f"{name}.load_state_dict(torch.load({path!r}, weights_only=True))"
        assert call in message, message
        eval(call, objects)  # the call as the message writes it loads the file
