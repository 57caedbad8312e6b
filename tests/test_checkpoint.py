"""Checkpoints in one process: formats, round trips, rotation, and every kind of bad input."""

from __future__ import annotations

import gc
import json
import os
import pickle
import random
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.overrides import TorchFunctionMode

import accel
from accel import RunContext
from accel._safetensors.manifests import MANIFEST
from accel.checkpoint._safetensors_io import read_file
from tests.models import TiedHeadLM

CTX = RunContext.single()


def _mlp(seed: int, width: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, width), nn.ReLU(), nn.Linear(width, 2))


def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


class Counter:
    """Any object with state_dict/load_state_dict."""

    def __init__(self) -> None:
        self.n = 0
        self.history: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "history": list(self.history), "t": torch.arange(3) * self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n, self.history = state["n"], list(state["history"])


# ------------------------------------------------------------------------ save_model


def test_save_model_single_file_is_plain_safetensors(tmp_path: Path) -> None:
    model = _mlp(0)
    accel.save_model(CTX, model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST, "model.safetensors"]
    loaded = load_file(tmp_path / "model.safetensors")  # read by safetensors itself
    assert loaded.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(loaded[k], v)


def test_save_model_shards_in_hugging_face_layout_and_loads_back(tmp_path: Path) -> None:
    model = _mlp(0, width=64)  # 3*64*4 = 768 B, 64*4 = 256 B, 2*64*4 = 512 B, 8 B
    accel.save_model(CTX, model, tmp_path, max_shard_size=700)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {
        "0.weight": "model-00001-of-00003.safetensors",
        "0.bias": "model-00002-of-00003.safetensors",
        "2.weight": "model-00003-of-00003.safetensors",
        "2.bias": "model-00003-of-00003.safetensors",
    }
    assert index["metadata"]["total_size"] == 768 + 256 + 512 + 8
    fresh = _mlp(1, width=64)
    assert accel.load_checkpoint_in_model(fresh, tmp_path) == ([], [])
    for a, b in zip(fresh.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_tied_weights_saved_once_and_restored_tied(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TiedHeadLM()
    accel.save_model(CTX, model, tmp_path)
    names = load_file(tmp_path / "model.safetensors").keys()
    assert sorted(names) == ["embed.weight", "mid.bias", "mid.weight"]
    torch.manual_seed(1)
    fresh = TiedHeadLM()
    accel.load_checkpoint_in_model(fresh, tmp_path / "model.safetensors")
    assert torch.equal(fresh.head.weight, model.embed.weight)
    assert fresh.head.weight is fresh.embed.weight
    with torch.no_grad():
        fresh.embed.weight.add_(1)
    assert torch.equal(fresh.head.weight, model.embed.weight + 1)


class _MovesCopy(TorchFunctionMode):
    """Every move to the CPU makes a new tensor, as it does for a tensor on a GPU: on a CPU,
    `t.cpu()` returns `t` itself, so code that finds ties after moving works here by luck."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        moves = func is torch.Tensor.cpu or (
            func is torch.Tensor.to and any(str(a) == "cpu" for a in (*args[1:], *kwargs.values()))
        )
        if moves and isinstance(out, torch.Tensor) and out is args[0]:
            with torch._C.DisableTorchFunction():
                return out.clone()
        return out


def test_save_model_of_a_model_elsewhere_keeps_ties_like_the_cpu_save(tmp_path: Path) -> None:
    """An export does not depend on where the model sat: ties are found before the tensors
    move to the CPU (a GPU save wrote the tied head twice, 6 shards against the CPU's 5)."""
    torch.manual_seed(0)
    model = TiedHeadLM()
    accel.save_model(CTX, model, tmp_path / "here", max_shard_size=60)
    with _MovesCopy():
        accel.save_model(CTX, model, tmp_path / "moved", max_shard_size=60)
    assert sorted(_snapshot(tmp_path / "moved")) == sorted(_snapshot(tmp_path / "here"))
    assert _snapshot(tmp_path / "moved") == _snapshot(tmp_path / "here")
    index = json.loads((tmp_path / "moved" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["tied"] == {"head.weight": "embed.weight"}


@pytest.mark.slow
def test_save_model_unwraps_compile_and_keeps_bf16(tmp_path: Path) -> None:
    model = _mlp(0).to(torch.bfloat16)
    accel.save_model(CTX, torch.compile(model), tmp_path)
    loaded = load_file(tmp_path / "model.safetensors")
    assert loaded["0.weight"].dtype == torch.bfloat16
    assert torch.equal(loaded["0.weight"], model[0].weight)


def test_bad_max_shard_size(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"max_shard_size='5 parsecs'.*'5GB'"):
        accel.save_model(CTX, _mlp(0), tmp_path, max_shard_size="5 parsecs")


# ------------------------------------------------------------------------ bad checkpoints


def _flip_byte(path: Path, offset_from_end: int = 3) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x40
    path.write_bytes(bytes(data))


def test_truncated_and_bit_flipped_weights_are_refused(tmp_path: Path) -> None:
    accel.save_model(CTX, _mlp(0), tmp_path)
    file = tmp_path / "model.safetensors"
    good = file.read_bytes()
    _flip_byte(file)
    with pytest.raises(ValueError, match=r"model\.safetensors.*fails its checksum"):
        accel.load_checkpoint_in_model(_mlp(1), tmp_path)
    file.write_bytes(good[:-5])
    with pytest.raises(
        ValueError, match=r"model\.safetensors.*\(size \d+; the manifest recorded size \d+"
    ):
        accel.load_checkpoint_in_model(_mlp(1), tmp_path)
    (tmp_path / MANIFEST).unlink()  # a plain safetensors folder: the header catches truncation
    with pytest.raises(ValueError, match=r"model\.safetensors.*not a valid safetensors file"):
        accel.load_checkpoint_in_model(_mlp(1), tmp_path)


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path: Path) -> None:
    accel.save_model(CTX, _mlp(0, width=4), tmp_path)
    other = _mlp(0, width=6)
    before = [p.clone() for p in other.parameters()]
    with pytest.raises(
        ValueError, match=r"'0\.weight' has shape \(4, 3\) in the checkpoint but \(6, 3\)"
    ):
        accel.load_checkpoint_in_model(other, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters(), strict=True))


def test_strict_key_mismatch(tmp_path: Path) -> None:
    accel.save_model(CTX, nn.Linear(3, 2, bias=False), tmp_path)
    with pytest.raises(ValueError, match=r"missing \['bias'\]"):
        accel.load_checkpoint_in_model(nn.Linear(3, 2), tmp_path)
    result = accel.load_checkpoint_in_model(nn.Linear(3, 2), tmp_path, strict=False)
    assert result == (["bias"], [])


def _sharded(tmp_path: Path) -> Path:
    accel.save_model(CTX, _mlp(0, width=64), tmp_path, max_shard_size=700)
    return tmp_path / "model.safetensors.index.json"


def test_missing_shard_is_named(tmp_path: Path) -> None:
    _sharded(tmp_path)
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"shard 'model-00002-of-00003\.safetensors'"):
        accel.load_checkpoint_in_model(_mlp(1, width=64), tmp_path)


@pytest.mark.parametrize(
    "target", ["../outside.safetensors", "/etc/passwd", "a/../../x.safetensors"]
)
def test_index_paths_outside_the_folder_are_refused_and_nothing_deleted(
    tmp_path: Path, target: str
) -> None:
    ckpt = tmp_path / "ckpt"
    index = _sharded(ckpt)
    (tmp_path / "outside.safetensors").write_bytes(b"precious")
    data = json.loads(index.read_text())
    data["weight_map"]["0.bias"] = target
    index.write_text(json.dumps(data))
    before = _snapshot(tmp_path)
    with pytest.raises(ValueError, match="outside the checkpoint folder"):
        accel.load_checkpoint_in_model(_mlp(1, width=64), index)
    assert _snapshot(tmp_path) == before


def test_load_checkpoint_in_model_takes_no_device_map(tmp_path: Path) -> None:
    # Placing modules across devices is dispatch_checkpoint's job; the keyword does not exist.
    accel.save_model(CTX, _mlp(0), tmp_path)
    with pytest.raises(TypeError, match="device_map"):
        accel.load_checkpoint_in_model(_mlp(0), tmp_path, device_map={"": "cpu"})  # type: ignore[call-arg]


# ------------------------------------------------------------------------ save_state


def _train_objects(seed: int) -> tuple[nn.Module, Any, Any, Any, Counter, torch.Generator]:
    model = _mlp(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    return model, opt, sched, scaler, Counter(), torch.Generator().manual_seed(seed)


def _step(model: nn.Module, opt: Any, sched: Any) -> None:
    model(torch.ones(2, 3)).square().sum().backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def test_save_state_round_trip_restores_every_object_and_rng(tmp_path: Path) -> None:
    model, opt, sched, scaler, counter, gen = _train_objects(0)
    for _ in range(3):
        _step(model, opt, sched)
    scaler.scale(torch.ones(()))  # the scaler's state exists once it has scaled something
    scaler.update(new_scale=64.0)
    counter.n, counter.history = 7, [1.5, float("inf")]
    torch.randperm(5, generator=gen)
    accel.set_seed(123)
    accel.save_state(CTX, tmp_path / "s", model=model, optimizer=opt, scheduler=sched,
                     scaler=scaler, counter=counter, gen=gen)  # fmt: skip
    sched_state = sched.state_dict()
    expected_rng = (torch.rand(3), np.random.rand(), random.random(), torch.rand(3, generator=gen))
    _step(model, opt, sched)  # keep the next step's reference
    reference = [p.detach().clone() for p in model.parameters()]

    m2, o2, s2, sc2, c2, g2 = _train_objects(5)
    accel.load_state(CTX, tmp_path / "s", model=m2, optimizer=o2, scheduler=s2,
                     scaler=sc2, counter=c2, gen=g2)  # fmt: skip
    got_rng = (torch.rand(3), np.random.rand(), random.random(), torch.rand(3, generator=g2))
    assert torch.equal(got_rng[0], expected_rng[0]) and got_rng[1:3] == expected_rng[1:3]
    assert torch.equal(got_rng[3], expected_rng[3])
    assert (c2.n, c2.history) == (7, [1.5, float("inf")])
    assert sc2.get_scale() == 64.0
    assert s2.state_dict() == sched_state and s2.get_last_lr() == [0.05]
    _step(m2, o2, s2)
    assert all(torch.equal(a, b) for a, b in zip(m2.parameters(), reference, strict=True))


def test_state_files_are_safetensors_json_and_a_manifest(tmp_path: Path) -> None:
    model, opt, sched, *_ = _train_objects(0)
    _step(model, opt, sched)
    accel.save_state(CTX, tmp_path / "s", model=model, optimizer=opt)
    files = sorted(str(p.relative_to(tmp_path / "s")) for p in (tmp_path / "s").rglob("*.*"))
    assert files == [
        MANIFEST, "model.json", "model.safetensors", "optimizer.json", "optimizer.safetensors",
        "rng/rank0.json", "rng/rank0.safetensors",
    ]  # fmt: skip
    manifest = json.loads((tmp_path / "s" / MANIFEST).read_text())
    assert manifest["world_size"] == 1 and manifest["torch_version"] == torch.__version__
    for rel, (size, crc) in manifest["files"].items():
        data = (tmp_path / "s" / rel).read_bytes()
        assert (len(data), zlib.crc32(data)) == (size, crc)
    assert not list(tmp_path.glob(".*"))  # no staging directory left behind


def test_load_state_refuses_no_manifest_and_corrupt_files(tmp_path: Path) -> None:
    model, opt, *_ = _train_objects(0)
    d = tmp_path / "s"
    accel.save_state(CTX, d, model=model, optimizer=opt)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        accel.load_state(CTX, tmp_path / "nope", model=model)
    _flip_byte(d / "optimizer.safetensors", 1)
    with pytest.raises(ValueError, match=r"optimizer\.safetensors.*fails its checksum"):
        accel.load_state(CTX, d, model=model, optimizer=opt)
    (d / "model.json").write_text((d / "model.json").read_text() + " ")
    with pytest.raises(ValueError, match=r"model\.json.*fails its checksum"):
        accel.load_state(CTX, d, model=model)
    (d / MANIFEST).unlink()
    with pytest.raises(FileNotFoundError, match=r"no accel-manifest\.json"):
        accel.load_state(CTX, d, model=model)


def test_a_flipped_bit_deep_in_a_multi_chunk_file_is_caught(tmp_path: Path) -> None:
    # 20 MiB of weights: the checksum is computed in 8 MiB chunks on several threads at save
    # and load; a bit flipped in a later chunk must still fail it.
    model = torch.nn.Linear(2560, 2048)
    d = tmp_path / "s"
    accel.save_state(CTX, d, model=model)
    manifest = json.loads((d / MANIFEST).read_text())
    data = (d / "model.safetensors").read_bytes()
    assert len(data) > 2 * (8 << 20)
    assert manifest["files"]["model.safetensors"] == [len(data), zlib.crc32(data)]
    accel.load_state(CTX, d, model=torch.nn.Linear(2560, 2048))  # intact: loads
    for position in ((8 << 20) + 100, len(data) - 5):  # the second chunk, the last chunk
        _flip_byte(d / "model.safetensors", len(data) - position)
        with pytest.raises(ValueError, match=r"model\.safetensors.*fails its checksum"):
            accel.load_state(CTX, d, model=model)
        _flip_byte(d / "model.safetensors", len(data) - position)  # back as it was
    accel.load_state(CTX, d, model=model)


class Boom:
    """A pickle that would create a marker file if anything unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (self.marker, "executed"))


def _plant(d: Path, rel: str, payload: bytes) -> None:
    (d / rel).write_bytes(payload)
    manifest = json.loads((d / MANIFEST).read_text())
    manifest["files"][rel] = [len(payload), zlib.crc32(payload)]  # even a matching manifest
    (d / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("rel", ["optimizer.safetensors", "optimizer.json", "rng/rank0.json"])
def test_planted_pickle_is_never_executed(tmp_path: Path, rel: str) -> None:
    model, opt, *_ = _train_objects(0)
    d = tmp_path / "s"
    accel.save_state(CTX, d, model=model, optimizer=opt)
    marker = tmp_path / "marker"
    payload = pickle.dumps(Boom(marker))
    assert not marker.exists()
    _plant(d, rel, payload)
    before = _snapshot(tmp_path)
    refusal = r"(not a valid safetensors|not JSON|is a pickle checkpoint)"
    with pytest.raises(ValueError, match=rf"{rel.split('/')[-1]}.*{refusal}"):
        accel.load_state(CTX, d, model=model, optimizer=opt)
    assert not marker.exists()
    assert _snapshot(tmp_path) == before


def test_planted_pickle_as_dcp_metadata_is_never_executed(tmp_path: Path) -> None:
    from accel.checkpoint._dcp import _reader

    marker = tmp_path / "marker"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Boom(marker)))
    with pytest.raises(pickle.UnpicklingError, match="not DCP metadata"):
        _reader(tmp_path).read_metadata()
    assert not marker.exists()


def test_bad_objects_and_names(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"thing=int has no state_dict"):
        accel.save_state(CTX, tmp_path / "s", thing=3)
    with pytest.raises(ValueError, match="'rng' is reserved"):
        accel.save_state(CTX, tmp_path / "s", rng=Counter())

    class Weird(Counter):
        def state_dict(self) -> dict[str, Any]:
            return {"f": {1, 2}}

    with pytest.raises(TypeError, match=r"state at 'w\.f' is a set"):
        accel.save_state(CTX, tmp_path / "s", w=Weird())
    accel.save_state(CTX, tmp_path / "s", c=Counter())
    with pytest.raises(ValueError, match=r"no 'missing\.json'.*saved objects: \['c'\]"):
        accel.load_state(CTX, tmp_path / "s", missing=Counter())


def test_state_codec_round_trips_odd_keys_and_types() -> None:
    from accel.checkpoint._state_codec import decode, encode

    tree = {1: (2.5, None, "s"), "__tuple__": [True], "d": torch.float16,
            "dev": torch.device("cpu"), "a": np.arange(3), "t": torch.ones(2)}  # fmt: skip
    tensors: dict[str, torch.Tensor] = {}
    back = decode("t", json.loads(json.dumps(encode("t", tree, "x", tensors))), tensors)
    assert back[1] == (2.5, None, "s") and back["__tuple__"] == [True]
    assert back["d"] is torch.float16 and back["dev"] == torch.device("cpu")
    assert back["a"].tolist() == [0, 1, 2] and torch.equal(back["t"], torch.ones(2))


# ------------------------------------------------------------------------ save_checkpoint


def test_rotation_keeps_newest_and_latest_skips_incomplete(tmp_path: Path) -> None:
    counter = Counter()
    for step in (1, 2, 3):
        counter.n = step
        handle = accel.save_checkpoint(CTX, tmp_path, {"c": counter}, step=step, keep=2)
        assert handle.wait() == tmp_path / f"step-{step}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-3"]
    # An interrupted later save, a folder without manifest and a truncated one are all skipped.
    (tmp_path / ".step-9.partial").mkdir()
    (tmp_path / "step-7").mkdir()
    accel.save_checkpoint(CTX, tmp_path, {"c": counter}, step=8)
    with open(tmp_path / "step-8" / "c.safetensors", "r+b") as f:
        f.truncate(10)
    latest = accel.latest_checkpoint(tmp_path)
    assert latest == tmp_path / "step-3"
    fresh = Counter()
    accel.load_state(CTX, latest, c=fresh)
    assert fresh.n == 3


def test_keep_one_never_leaves_zero(tmp_path: Path) -> None:
    counter = Counter()
    accel.save_checkpoint(CTX, tmp_path, {"c": counter}, step=0, keep=1)

    class Failing(Counter):
        def state_dict(self) -> dict[str, Any]:
            return {"x": object()}

    with pytest.raises(TypeError):
        accel.save_checkpoint(CTX, tmp_path, {"c": Failing()}, step=1, keep=1)
    assert accel.latest_checkpoint(tmp_path) == tmp_path / "step-0"
    accel.save_checkpoint(CTX, tmp_path, {"c": counter}, step=2, keep=1)
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == ["step-2"]


def test_async_save_holds_a_copy_and_the_next_save_waits(tmp_path: Path) -> None:
    model = _mlp(0)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    h1 = accel.save_checkpoint(CTX, tmp_path, {"model": model}, step=1, blocking=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training goes on while the write runs
    h2 = accel.save_checkpoint(CTX, tmp_path, {"model": model}, step=2, blocking=False, keep=5)
    assert h1.done()  # the second save waited for the first
    assert h2.wait() == tmp_path / "step-2" and h2.done()
    first = load_file(tmp_path / "step-1" / "model.safetensors")
    assert all(torch.equal(first[f"model.{k}"], v) for k, v in saved.items())
    second = _mlp(3)
    accel.load_state(CTX, accel.latest_checkpoint(tmp_path), model=second)
    assert all(
        torch.equal(a, b) for a, b in zip(second.parameters(), model.parameters(), strict=True)
    )


def test_bad_step_and_keep(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"step=-1"):
        accel.save_checkpoint(CTX, tmp_path, {}, step=-1)
    with pytest.raises(ValueError, match=r"keep=0"):
        accel.save_checkpoint(CTX, tmp_path, {}, step=1, keep=0)
    assert accel.latest_checkpoint(tmp_path / "none") is None
    assert os.listdir(tmp_path) == []


def test_sharded_loader_position_resumes_mid_epoch(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    def loader() -> Any:
        data = DataLoader(list(range(20)), batch_size=2, shuffle=True,
                          generator=torch.Generator().manual_seed(0))  # fmt: skip
        return accel.shard_loader(CTX, data, seed=3)

    first = loader()
    first.set_epoch(1)
    it = iter(first)
    seen = [next(it).tolist() for _ in range(4)]
    accel.save_state(CTX, tmp_path / "s", loader=first)
    rest = [b.tolist() for b in it]
    resumed = loader()
    accel.load_state(CTX, tmp_path / "s", loader=resumed)
    assert [b.tolist() for b in resumed] == rest
    assert len(seen) + len(rest) == 10


def _mapped_files() -> str:
    return Path("/proc/self/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc")
def test_loaded_state_does_not_keep_the_checkpoint_mapped(tmp_path: Path) -> None:
    # Rotating a checkpoint away must free its disk space, and the first optimizer step must
    # not fault pages in from the file: nothing loaded may keep viewing the file.
    model, opt, sched, *_ = _train_objects(0)
    _step(model, opt, sched)
    d = tmp_path / "s"
    accel.save_state(CTX, d, model=model, optimizer=opt, scheduler=sched)
    model2, opt2, sched2, *_ = _train_objects(1)
    accel.load_state(CTX, d, model=model2, optimizer=opt2, scheduler=sched2)
    gc.collect()
    assert str(d.resolve()) not in _mapped_files()
    viewing = read_file("test", d / "optimizer.safetensors", None)  # a view does show up there
    assert str(d.resolve()) in _mapped_files()
    del viewing
    for (p, q), (a, b) in zip(
        zip(model.parameters(), model2.parameters(), strict=True),
        zip(opt.state.values(), opt2.state.values(), strict=True),
        strict=True,
    ):
        assert torch.equal(p, q) and torch.equal(a["exp_avg"], b["exp_avg"])


def test_one_state_dict_serves_save_state_save_checkpoint_and_load_state(tmp_path: Path) -> None:
    model = _mlp(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    state = {"model": model, "optimizer": opt}
    accel.save_state(CTX, tmp_path / "state", state)
    handle = accel.save_checkpoint(CTX, tmp_path / "ckpts", state, step=1)
    for directory in (tmp_path / "state", handle.wait()):
        fresh = _mlp(2)
        fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
        loaded = accel.load_state(CTX, directory, {"model": fresh, "optimizer": fresh_opt})
        assert loaded["objects"] == ["model", "optimizer"]
        for a, b in zip(fresh.parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b)
        assert fresh_opt.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    # The dict and keyword arguments combine; an object may still be named "state".
    gen = torch.Generator().manual_seed(5)
    accel.save_state(CTX, tmp_path / "both", {"model": model}, state=gen)
    assert accel.load_state(CTX, tmp_path / "both", state=torch.Generator())["objects"] == [
        "model",
        "state",
    ]


@pytest.mark.parametrize(
    ("state", "kwargs", "error", "match"),
    [
        ({"model": nn.Linear(2, 2)}, {"model": nn.Linear(2, 2)}, ValueError,
         r"save_state: \['model'\] given both in state and as keyword arguments"),
        ([nn.Linear(2, 2)], {}, TypeError, r"save_state: state=\[Linear.* must be a dict of name"),
        ({1: nn.Linear(2, 2)}, {}, TypeError, r"save_state: state=\{1: .* must be a dict of name"),
    ],
)  # fmt: skip
def test_a_state_that_is_not_one_dict_of_names_is_refused(
    tmp_path: Path, state: Any, kwargs: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        accel.save_state(CTX, tmp_path / "s", state, **kwargs)
    assert not (tmp_path / "s").exists()
