"""Sharded models and safetensors: each rank loads and saves only its own slices.

Every check compares against an independent reference: the same model loaded whole in one
process (`load_state_dict` of safetensors' own `load_file`), and `save_model` of the unsharded
model for byte-identical files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import accel
from accel import RunContext
from accel.testing import run_world
from tests.models import Stack, Uneven

pytestmark = pytest.mark.dist

TIMEOUT = 120


def _tiny(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Uneven()


def _fsdp2(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in (model.up, model.down, model.head):
        fully_shard(layer)
    fully_shard(model)
    return model


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def _tp(model: nn.Module, placements: tuple[Any, Any]) -> nn.Module:
    """Every 2-D weight distributed with `placements` on a 2x2 mesh; 1-D tensors Shard(0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    done: dict[int, nn.Parameter] = {}
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        module, attr = name.rsplit(".", 1)
        if id(p) not in done:
            spec = placements if p.ndim == 2 else (Replicate(), Shard(0))
            done[id(p)] = nn.Parameter(distribute_tensor(p.detach().clone(), mesh, spec))
        setattr(model.get_submodule(module), attr, done[id(p)])
    return model


def _load_checks(ctx: RunContext, checkpoint: str) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard

    reference = _tiny().state_dict()
    results: dict[str, Any] = {}
    fsdp = _fsdp2(_tiny(seed=1))
    result = accel.load_checkpoint_in_model(fsdp, checkpoint)
    results["fsdp2"] = _full(fsdp)
    results["result"] = result
    results["reference"] = reference
    if ctx.world_size == 4:
        for spec in [(Shard(0), Shard(1)), (Shard(1), Shard(0)), (Replicate(), Shard(1))]:
            model = _tp(_tiny(seed=1), spec)
            accel.load_checkpoint_in_model(model, checkpoint)
            results[f"tp {spec}"] = _full(model)
        both = _fsdp2_tp(_tiny(seed=1))  # FSDP2 over tensor parallel: _StridedShard rows
        accel.load_checkpoint_in_model(both, checkpoint)
        results["fsdp2 x tp"] = _full(both)
    return results


def _load_each(ctx: RunContext, root: str) -> dict[str, dict[str, Any]]:
    """`_load_checks` of each layout saved under `root`, in one world."""
    return {layout: _load_checks(ctx, f"{root}/{layout}") for layout in ("shards", "single")}


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_load_equals_full_load_then_shard(tmp_path: Path, world_size: int) -> None:
    source = _tiny()
    for layout, size in (("shards", 200), ("single", "5GB")):
        accel.save_model(RunContext.single(), source, tmp_path / layout, max_shard_size=size)
        assert (len(list((tmp_path / layout).glob("*.safetensors"))) > 1) == (layout == "shards")
    reference = source.state_dict()
    results = run_world(_load_each, world_size=world_size, timeout=TIMEOUT, args=(str(tmp_path),))
    for per_rank in results:
        for layout, checks in per_rank.items():
            assert checks["result"] == accel.LoadResult([], []), layout
            for case, state in checks.items():
                if case in ("result", "reference"):
                    continue
                assert state.keys() == reference.keys(), (layout, case)
                for k, v in reference.items():
                    assert torch.equal(state[k], v), (layout, case, k)


def _meta_load(ctx: RunContext, checkpoint: str) -> dict[str, torch.Tensor]:
    with accel.init_empty_weights():
        model = _fsdp2(_tiny())  # sharded on meta: no rank ever holds the full model
    accel.load_checkpoint_in_model(model, checkpoint)
    return _full(model)


def test_model_built_empty_and_sharded_then_loaded(tmp_path: Path) -> None:
    source = _tiny()
    accel.save_model(RunContext.single(), source, tmp_path, max_shard_size=200)
    for state in run_world(_meta_load, world_size=2, timeout=TIMEOUT, args=(str(tmp_path),)):
        assert all(torch.equal(state[k], v) for k, v in source.state_dict().items())


def test_sharded_load_verifies_checksums_from_the_manifest(tmp_path: Path) -> None:
    accel.save_model(RunContext.single(), _tiny(), tmp_path, max_shard_size=200)
    shard = sorted(tmp_path.glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # one flipped bit in the last tensor's bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{shard.name}.*fails its checksum"):
        run_world(_meta_load, world_size=2, timeout=TIMEOUT, args=(str(tmp_path),))


def _peak_during(load: Any) -> int:
    """Bytes the process's resident set grew by, at its peak, while `load()` ran."""
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS

    def status(key: str) -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if key in x)
        return int(line.split()[1]) * 1024

    before = status("VmRSS")
    load()
    return status("VmHWM") - before


def _load_peak(ctx: RunContext, checkpoint: str, kind: str) -> int:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    with accel.init_empty_weights():
        model = Stack()
    if kind == "fsdp2":
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    else:  # column-sharded weights: strided reads
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (ctx.world_size,))
        for layer in model.layers:
            layer.weight = nn.Parameter(distribute_tensor(layer.weight, mesh, [Shard(1)]))
    model.to_empty(device="cpu")  # this rank's 1/N, allocated (and touched) before measuring
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(0)
    loading = _peak_during(lambda: accel.load_checkpoint_in_model(model, checkpoint))
    saving = _peak_during(lambda: accel.save_model(ctx, model, f"{checkpoint}-{kind}-saved"))
    return loading, saving


@pytest.mark.parametrize("kind", ["fsdp2", "tp-columns"])
def test_sharded_load_and_save_peak_memory_is_one_slice_not_the_model(
    tmp_path: Path, kind: str
) -> None:
    torch.manual_seed(0)
    source = tmp_path / "hf"
    accel.save_model(RunContext.single(), Stack(), source, max_shard_size="16MB")
    world_size = 4
    peaks = run_world(_load_peak, world_size=world_size, timeout=TIMEOUT,
                      args=(str(source), kind))  # fmt: skip
    model_bytes, largest_slice = 64 << 20, (4 << 20) // world_size
    allowance = 4 << 20  # Python objects, headers, a 1 MiB checksum buffer
    # The rank's own 1/N is allocated before the measurement, so the growth allowed while
    # loading is the largest tensor slice plus the allowance, and while saving one tensor
    # plus the allowance: far below the 64 MiB model.
    assert max(p[0] for p in peaks) <= largest_slice + allowance, (peaks, model_bytes)
    assert max(p[1] for p in peaks) <= (4 << 20) + allowance, (peaks, model_bytes)
    plain = tmp_path / "plain"
    accel.save_model(RunContext.single(), _stack_from(source), plain)
    saved = Path(f"{source}-{kind}-saved") / "model.safetensors"
    assert saved.read_bytes() == (plain / "model.safetensors").read_bytes()
    print(f"peak growth per rank (MiB), load / save: {[(a >> 20, b >> 20) for a, b in peaks]}")


def _stack_from(checkpoint: Path) -> nn.Module:
    model = Stack()
    accel.load_checkpoint_in_model(model, checkpoint)
    return model


def _fsdp2_tp(model: nn.Module) -> nn.Module:
    """Tensor parallel on the inner mesh axis, FSDP2 on the outer (torch's 2-D recipe)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    parallelize_module(model, mesh["tp"], plan)  # type: ignore[arg-type]
    for layer in (model.up, model.down, model.head):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _halving(pwrite: Any) -> Any:
    """`os.pwrite` stopping halfway through every write, as the kernel may (a signal, a disk
    filling up) and report it: a writer must go on from where the write stopped."""

    vectored = pwrite is os.pwritev  # os.pwritev takes a list of buffers

    def half(fd: int, data: Any, offset: int) -> int:
        view = memoryview(data)
        part = view[: max(1, len(view) // 2)]
        return int(pwrite(fd, [part], offset) if vectored else pwrite(fd, part, offset))

    return half


def _save_sharded(ctx: RunContext, root: str, kind: str) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import Shard

    model = _tiny(seed=3)
    if kind.startswith("fsdp2xtp"):
        model = _fsdp2_tp(model)
    elif kind.startswith("fsdp2"):
        model = _fsdp2(model)
    else:
        model = _tp(model, (Shard(1), Shard(0)))
    reference = _full(model)
    if kind.endswith("-read-back"):  # too many runs to combine: checksums read the files back
        from accel.checkpoint import _sharded_save

        _sharded_save._MAX_COMBINED = 1
    if "-unshared" in kind:  # as if the ranks did not share the filesystem
        from accel.checkpoint import _sharded_save

        _sharded_save._survey = lambda *args: (False, [])  # type: ignore[assignment]
    if kind.endswith("-inline-crc"):  # checksums inline, whatever the cores, in 8-byte pieces
        from accel.checkpoint import _safetensors_io, _sharded_save

        _sharded_save.usable_cpus = lambda: 1  # type: ignore[assignment]
        _safetensors_io.PIECE = 8
    if kind.endswith("-short-writes"):
        os.pwrite = _halving(os.pwrite)
        pwritev = _halving(os.pwritev)
        os.pwritev = lambda fd, buffers, offset: pwritev(fd, *buffers, offset)  # one buffer
    accel.save_model(ctx, model, f"{root}/{kind}", max_shard_size=200)
    if kind == "fsdp2xtp":  # and load it back into the 2-D model
        again = _fsdp2_tp(_tiny(seed=9))
        accel.load_checkpoint_in_model(again, f"{root}/{kind}")
        assert all(torch.equal(v, reference[k]) for k, v in _full(again).items())
    return reference


SHARDED_SAVES = [
    (1, "fsdp2"), (2, "fsdp2"), (4, "fsdp2"), (4, "tp-2d"), (4, "tp-2d-read-back"), (4, "fsdp2xtp"),
    (4, "fsdp2xtp-unshared"), (2, "fsdp2-short-writes"), (2, "fsdp2-unshared-short-writes"),
    (2, "fsdp2-inline-crc"),
]  # fmt: skip


@pytest.mark.parametrize(("world_size", "kind"), SHARDED_SAVES)
def test_sharded_save_model_files_equal_the_unsharded_save(
    tmp_path: Path, world_size: int, kind: str
) -> None:
    results = run_world(_save_sharded, world_size=world_size, timeout=TIMEOUT,
                        args=(str(tmp_path), kind))  # fmt: skip
    unsharded = Uneven()
    unsharded.load_state_dict(results[0])
    accel.save_model(RunContext.single(), unsharded, tmp_path / "plain", max_shard_size=200)
    sharded = tmp_path / kind
    names = sorted(p.name for p in (tmp_path / "plain").iterdir())
    assert sorted(p.name for p in sharded.iterdir()) == names  # no partial files left behind
    assert any(n.startswith("model-00002-of-") for n in names)
    for name in names:
        assert (sharded / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name
    for shard in sharded.glob("*.safetensors"):  # and plain safetensors reads them
        for k, v in load_file(shard).items():
            assert torch.equal(v, results[0][k])


def _save_failing_on_one_rank(ctx: RunContext, root: str, failing: int, where: str) -> str:
    import errno

    from accel.checkpoint import _sharded_save

    model = _fsdp2(_tiny(seed=3))
    accel.save_model(ctx, model, root, max_shard_size=200)  # the save to keep
    if ctx.rank == failing:  # this rank's disk fills up

        def full(*args: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        if where == "create":  # rank 0 creating the files
            _sharded_save.presize = full  # type: ignore[assignment]
        elif where == "publish":  # rank 0 writing the index and manifest
            from accel.checkpoint import _atomic

            _atomic.write_bytes = full  # type: ignore[assignment]
        else:
            os.pwrite = full
    if where == "stream":  # as if the ranks did not share the filesystem: rank 0 writes all
        _sharded_save._survey = lambda *args: (False, [])  # type: ignore[assignment]
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(1.0)
    try:
        accel.save_model(ctx, model, root, max_shard_size=200)
    except OSError as err:
        return f"{err.errno} {err}"
    return "saved"


@pytest.mark.parametrize(
    ("failing", "where"),
    [(0, "write"), (1, "write"), (0, "create"), (0, "stream"), (0, "publish")],
)
def test_a_rank_failing_to_write_fails_the_sharded_save_on_every_rank(
    tmp_path: Path, failing: int, where: str
) -> None:
    # Every rank must learn of the failure from the save's own collectives, and none publish;
    # before, the failing rank raised and the others waited in the next collective until the
    # timeout.
    root = tmp_path / "model"
    results = run_world(_save_failing_on_one_rank, world_size=2, timeout=60,
                        args=(str(root), failing, where))  # fmt: skip
    assert all(r.startswith("28 ") and str(root) in r for r in results), results
    assert all(f"rank {failing}" in r for i, r in enumerate(results) if i != failing), results
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []  # no partials
    reference = _full(_tiny(seed=3))  # the model as first saved, unsharded
    model = Uneven()
    accel.load_checkpoint_in_model(model, root)  # the earlier save, whole and verified
    for k, v in model.state_dict().items():
        assert torch.equal(v, reference[k]), k


def _save_state_sharded(ctx: RunContext, directory: str) -> dict[str, torch.Tensor]:
    model = _fsdp2(_tiny(seed=4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.up(torch.randn(3, 6)).square().mean().backward()  # up is its own FSDP2 unit
    opt.step()
    opt.zero_grad(set_to_none=True)
    accel.save_state(ctx, directory, model=model, optimizer=opt)
    return _full(model)


def test_merge_weights_of_a_sharded_checkpoint_loads_with_equal_parameters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from accel_cli import main

    src, dst = tmp_path / "state", tmp_path / "merged"
    trained = run_world(_save_state_sharded, world_size=2, timeout=TIMEOUT, args=(str(src),))[0]
    monkeypatch.setattr(os, "pwrite", _halving(os.pwrite))
    assert main(["merge-weights", str(src), str(dst), "--max-shard-size", "200"]) == 0
    assert (dst / "model.safetensors.index.json").is_file()
    model = Uneven()
    assert accel.load_checkpoint_in_model(model, dst) == accel.LoadResult([], [])
    for k, v in model.state_dict().items():
        assert torch.equal(v, trained[k]), k
    assert main(["merge-weights", str(dst), str(tmp_path / "x")]) == 2  # not a DCP checkpoint
    assert "merge-weights: error: " in capsys.readouterr().err
