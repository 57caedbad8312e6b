"""SIGKILL between the renames of `save_model`'s publish: the folder always loads as the complete
previous export or the complete new one, and the next load or save finishes what was left.

A forked child saves into a folder holding an earlier export and kills itself just before
its k-th rename or removal (k = 1, 2, ... until a save completes). Each state it leaves is
copied and loaded by `load_checkpoint_in_model`, by `dispatch_checkpoint` and by the next
`save_model`; the weights must equal one of the two models exactly: the old one when the kill
came before the new export was decided (its journal written), the new one after.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import accel
from accel import RunContext

CTX = RunContext.single()
TENSOR_BYTES = 16 * 16 * 4  # one weight; a bias is 64 bytes
LAYOUTS = {"single": "5GB", "three": 2 * TENSOR_BYTES, "two": 3 * TENSOR_BYTES}


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16))


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _model(seed).state_dict().items()}


def _save_killed_at(folder: str, seed: int, max_shard_size: int | str, k: int) -> None:
    torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork
    count = [0]

    def counted(real: Any) -> Any:
        def op(self: Path, *args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            if count[0] == k:  # just before the k-th rename or removal of the publish
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, *args, **kwargs)

        return op

    Path.replace = counted(Path.replace)  # type: ignore[method-assign]
    Path.unlink = counted(Path.unlink)  # type: ignore[method-assign]
    accel.save_model(CTX, _model(seed), folder, max_shard_size=max_shard_size)
    os._exit(0)


def _run_child(folder: Path, seed: int, layout: str, k: int) -> bool:
    """Save in a child killed at its k-th publish step; True when it was killed."""
    fork = mp.get_context("fork")
    with warnings.catch_warnings():
        # Python >= 3.12 warns about forking with threads; the child sets 1 thread first.
        warnings.simplefilter("ignore", DeprecationWarning)
        child = fork.Process(target=_save_killed_at, args=(str(folder), seed, LAYOUTS[layout], k))
        child.start()
    child.join(timeout=60)
    assert child.exitcode in (0, -signal.SIGKILL), child.exitcode
    return child.exitcode == -signal.SIGKILL


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _loaded(folder: Path, how: str) -> dict[str, torch.Tensor]:
    if how == "load_checkpoint_in_model":
        model = _model(99)
        accel.load_checkpoint_in_model(model, folder)
    else:
        with accel.init_empty_weights():
            model = _model(99)
        accel.dispatch_checkpoint(model, folder, device_map={"": "cpu"})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _plain(folder: Path) -> dict[str, torch.Tensor]:
    """What safetensors alone reads, transformers' way: model.safetensors first, else the index."""
    if (folder / "model.safetensors").is_file():
        return load_file(folder / "model.safetensors")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        out.update(load_file(folder / name))
    return out


def _assert_settled(folder: Path, expect: dict[str, torch.Tensor]) -> None:
    """Nothing hidden left; the files are exactly one export's, plain readers agree."""
    names = sorted(p.name for p in folder.iterdir())
    assert [n for n in names if n.startswith(".")] == [], names
    manifest = json.loads((folder / "accel-manifest.json").read_text())
    assert sorted(manifest["files"]) == [n for n in names if n != "accel-manifest.json"]
    assert _equal(_plain(folder), expect)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("old", "new"),
    [("single", "single"), ("three", "three"), ("single", "three"), ("three", "single"),
     ("three", "two")],
)  # fmt: skip
def test_a_kill_at_every_publish_step_leaves_a_complete_export(
    tmp_path: Path, old: str, new: str
) -> None:
    before, after = _weights(1), _weights(2)
    base = tmp_path / "base"
    accel.save_model(CTX, _model(1), base, max_shard_size=LAYOUTS[old])
    outcomes = []
    for k in range(1, 40):
        folder = tmp_path / f"k{k}"
        shutil.copytree(base, folder)
        if not _run_child(folder, 2, new, k):
            break
        # Before the journal's rename (step 1) nothing was decided: the old export stays.
        expect = before if k == 1 else after
        copies = {how: tmp_path / f"k{k}-{how}" for how in ("dispatch_checkpoint", "save")}
        for copy in copies.values():
            shutil.copytree(folder, copy)
        if new == "single":  # one atomic rename: plain readers see one export at every step
            assert _equal(_plain(folder), before) or _equal(_plain(folder), after)
        got = _loaded(folder, "load_checkpoint_in_model")
        assert _equal(got, expect), (k, "load_checkpoint_in_model")
        _assert_settled(folder, expect)  # the load finished (or undid) the killed save
        got = _loaded(copies["dispatch_checkpoint"], "dispatch_checkpoint")
        assert _equal(got, expect), (k, "dispatch_checkpoint")
        _assert_settled(copies["dispatch_checkpoint"], expect)
        accel.save_model(CTX, _model(3), copies["save"], max_shard_size=LAYOUTS[old])
        assert _equal(_loaded(copies["save"], "load_checkpoint_in_model"), _weights(3))
        _assert_settled(copies["save"], _weights(3))
        outcomes.append("new" if expect is after else "old")
    else:
        raise AssertionError("the save never completed")
    assert outcomes[0] == "old" and outcomes[-1] == "new" and len(outcomes) >= 3, outcomes
    assert _equal(_loaded(folder, "load_checkpoint_in_model"), after)  # the complete save
    _assert_settled(folder, after)


def test_a_save_killed_while_writing_leaves_the_old_export_and_no_partials_after_a_load(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "export"
    accel.save_model(CTX, _model(1), folder, max_shard_size=LAYOUTS["three"])
    partial = folder / ".model-00002-of-00003.safetensors.partial"  # as a killed write leaves
    partial.write_bytes(b"half a file")
    (folder / ".model.safetensors.partial").write_bytes(b"")
    (folder / "notes.txt").write_text("the user's file\n")
    assert _equal(_loaded(folder, "load_checkpoint_in_model"), _weights(1))
    names = sorted(p.name for p in folder.iterdir())
    assert [n for n in names if n.startswith(".")] == []
    assert (folder / "notes.txt").read_text() == "the user's file\n"
