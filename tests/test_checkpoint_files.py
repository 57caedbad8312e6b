from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from accel._safetensors.files import resolve_checkpoint


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
