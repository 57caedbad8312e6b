"""Big models: empty init, size accounting, exact device maps, dispatch equal to full loading,
offload hooks, bad input, and a ~1.5 GB checkpoint loaded under a 1 GiB CPU budget."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file, save_model
from torch import nn

import accel
from tests.models import Pair, TiedLayers, TinyLM, linears

# A Linear(4, 4) holds 16 + 4 floats = 80 bytes; Linear(4, 10) holds 200.


# ---- empty init and sizes -------------------------------------------------------------------


def test_init_empty_weights_puts_parameters_on_meta_and_keeps_buffers() -> None:
    with accel.init_empty_weights():
        model = TinyLM()
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert model.pos.device.type == "cpu" and model.pos.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert model.head.weight is model.embed.weight  # ties survive the move to meta
    with accel.init_empty_weights(include_buffers=True):
        model = TinyLM()
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
    assert nn.Module.register_parameter.__qualname__ == "Module.register_parameter"


def test_init_on_device_builds_on_that_device() -> None:
    with accel.init_on_device("cpu"):
        layer = nn.Linear(3, 2)
    assert layer.weight.device.type == "cpu" and layer.weight.requires_grad


def test_a_100_billion_parameter_model_builds_on_meta_without_memory() -> None:
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    before = rss()
    with accel.init_empty_weights():
        model = nn.Sequential(*[nn.Linear(10_000, 10_000, bias=False) for _ in range(1000)])
    assert rss() - before < 50 * 2**20  # 400 GB of fp32 weights, none of it allocated
    sizes = accel.compute_module_sizes(model, dtype=torch.bfloat16)
    plan = accel.infer_device_map(model, max_memory={0: 80 * 10**9, "cpu": 10**12})
    assert sum(p.numel() for p in model.parameters()) == 100_000_000_000
    assert sizes[""] == 200 * 10**9
    # 200 layers of 400 MB fill device 0; one layer's room is kept to run the CPU-held ones.
    assert list(plan.values()).count(0) == 199 and list(plan.values()).count("cpu") == 801


def test_sizes_count_buffers_dtypes_and_tied_tensors_once() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    # BatchNorm1d(4): weight, bias, running_mean, running_var (4 floats each) + int64 counter.
    assert accel.compute_module_sizes(model) == {"": 152, "0": 80, "1": 72}
    assert accel.compute_module_sizes(model, dtype=torch.float16) == {"": 80, "0": 40, "1": 40}
    tied = accel.compute_module_sizes(TiedLayers())
    assert tied == {"": 240, "embed": 160, "lin": 80, "head": 0}


# ---- device maps ----------------------------------------------------------------------------


def test_whole_model_on_one_device_when_it_fits() -> None:
    assert accel.infer_device_map(linears(4), max_memory={0: 320}) == {"": 0}


def test_room_for_the_largest_offloaded_layer_is_kept_on_the_first_device() -> None:
    # 3 layers fit in 250 bytes, but layer 3 then runs on device 0 from the CPU, so 80 bytes are
    # kept free there and only 2 layers stay.
    plan = accel.infer_device_map(linears(4), max_memory={0: 250, "cpu": 1000})
    assert plan == {"0": 0, "1": 0, "2": "cpu", "3": "cpu"}


def test_accelerators_fill_in_order_without_those_devices_present() -> None:
    plan = accel.infer_device_map(linears(5), max_memory={0: 200, 1: 200, "cpu": 10_000})
    # Device 0 keeps 80 bytes for layer 4, which runs on it from the CPU.
    assert plan == {"0": 0, "1": 1, "2": 1, "3": "cpu", "4": "cpu"}


def test_no_split_classes_move_whole() -> None:
    model = nn.Sequential(Pair(), Pair(), Pair())
    budgets = {0: 330, "cpu": 1000}
    assert accel.infer_device_map(model, max_memory=budgets, no_split=[Pair]) == {
        "0": 0,
        "1": "cpu",
        "2": "cpu",
    }
    # Split, device 0 keeps room for one Linear (80 B) and holds pair 0 and 1.lin1.
    assert accel.infer_device_map(model, max_memory=budgets) == {
        "0": 0,
        "1.lin1": 0,
        "1.lin2": "cpu",
        "2": "cpu",
    }


def test_buffers_count_in_the_plan() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))  # 80 + 72 bytes
    # The Linear goes first, keeping 72 B for the BatchNorm, which then fits exactly.
    assert accel.infer_device_map(model, max_memory={0: 152, 1: 1000}) == {"": 0}
    assert accel.infer_device_map(model, max_memory={0: 151, 1: 1000}) == {"": 1}


def test_dtype_is_respected() -> None:
    assert accel.infer_device_map(linears(4), max_memory={0: 160, 1: 1000}) == {
        "0": 0,
        "1": 1,
        "2": 1,
        "3": 1,
    }
    assert accel.infer_device_map(linears(4), max_memory={0: 160, 1: 1000}, dtype=torch.half) == {
        "": 0
    }


def test_tied_parameters_stay_on_one_device() -> None:
    # embed (160) and head (its tied weight only) go to device 0, which keeps 80 B for the
    # largest layer left; lin then does not fit beside them and goes to 1, tail too.
    model = TiedLayers()
    model.tail = nn.Linear(4, 4)
    plan = accel.infer_device_map(model, max_memory={0: 240, 1: 1000})
    assert plan == {"embed": 0, "head": 0, "lin": 1, "tail": 1}


def test_a_tied_group_that_does_not_fit_moves_whole() -> None:
    model = TiedLayers()
    model.tail = nn.Linear(4, 4)
    model.head.bias = nn.Parameter(torch.zeros(10))  # 40 bytes that must sit beside embed
    # embed alone would fit on 0 (160 B + 80 kept), with head it does not: all go to 1.
    assert accel.infer_device_map(model, max_memory={0: 240, 1: 1000}) == {"": 1}


def test_what_fits_nowhere_goes_to_disk() -> None:
    plan = accel.infer_device_map(linears(2), max_memory={0: 50, "cpu": 50})
    assert plan == {"": "disk"}


@pytest.mark.parametrize(
    ("max_memory", "match"),
    [
        ({"gpu": 10}, "'gpu' is not a device"),
        ({0: "lots"}, r"max_memory\[0\]='lots' is not a size"),
        ({0: -1}, r"max_memory\[0\]=-1 is not a size"),
        ({}, "non-empty dict"),
    ],
)
def test_bad_max_memory(max_memory: dict[int | str, int | str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        accel.infer_device_map(linears(1), max_memory=max_memory)


def test_sizes_as_strings() -> None:
    assert accel.infer_device_map(linears(2), max_memory={0: "0.16KB"}) == {"": 0}
    assert accel.infer_device_map(linears(20), max_memory={"cpu": "1KiB", "disk": "1GB"}) == {
        **{str(i): "cpu" for i in range(11)},
        **{str(i): "disk" for i in range(11, 20)},
    }


# ---- dispatch -------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path) -> tuple[TinyLM, Path]:
    torch.manual_seed(0)
    model = TinyLM()
    save_model(model, str(tmp_path / "model.safetensors"))  # stores the tied weight once
    return model, tmp_path


def empty_lm() -> TinyLM:
    with accel.init_empty_weights():
        return TinyLM()


IDS = torch.tensor([[1, 5, 7, 2, 30], [0, 3, 3, 9, 31]])
MIXED = {
    "embed": "cpu",
    "blocks.0": "disk",
    "blocks.1": "cpu",
    "blocks.2.lin1": "disk",
    "blocks.2": "cpu",
    "norm": "disk",
    "head": "cpu",
    "pos": "disk",  # a root buffer not in the checkpoint: held aside, put back for the forward
}


@pytest.mark.parametrize("device_map", [{"": "cpu"}, {"": "disk"}, MIXED], ids=str)
def test_dispatched_outputs_equal_the_fully_loaded_model(
    saved: tuple[TinyLM, Path], device_map: dict[str, int | str]
) -> None:
    reference, folder = saved
    model = accel.dispatch_checkpoint(empty_lm(), folder, device_map=device_map)
    assert torch.equal(model(IDS), reference(IDS))
    assert torch.equal(model(IDS), reference(IDS))  # hooks put placeholders back and reload
    if device_map == {"": "disk"}:
        assert model.blocks[0].lin1.weight.device.type == "meta"  # nothing kept in memory
    assert model.head.weight is model.embed.weight
    accel.remove_hooks(model)
    assert model.head.weight is model.embed.weight
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert torch.equal(model(IDS), reference(IDS))


def test_auto_map_with_disk_and_a_sharded_index(saved: tuple[TinyLM, Path]) -> None:
    reference, folder = saved
    state = load_file(folder / "model.safetensors")
    names = sorted(state)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    sharded = folder / "sharded"
    sharded.mkdir()
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, sharded / file)
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    model = accel.dispatch_checkpoint(
        empty_lm(), sharded, max_memory={"cpu": 5000}, offload_dir=folder / "offload"
    )
    plan = accel.infer_device_map(empty_lm(), max_memory={"cpu": 5000})
    # The CPU keeps room for the largest layer left (a 1088 B Linear) to run disk layers; head
    # is tied to embed, so it goes with it; the first block splits, the rest goes to disk.
    assert plan == {
        "embed": "cpu",
        "head": "cpu",
        "blocks.0.lin1": "cpu",
        "blocks.0.lin2": "disk",
        "blocks.0.shift": "disk",
        "blocks.1": "disk",
        "blocks.2": "disk",
        "norm": "disk",
        "pos": "disk",
    }
    assert model.hf_device_map == plan
    assert torch.equal(model(IDS), reference(IDS))
    assert not (folder / "offload" / "index.json").exists()  # read in place, nothing rewritten


def test_a_dtype_for_weights_kept_in_memory(saved: tuple[TinyLM, Path]) -> None:
    reference, folder = saved
    model = accel.dispatch_checkpoint(
        empty_lm(), folder, device_map={"": "cpu"}, dtype=torch.bfloat16
    )
    assert model.blocks[0].lin1.weight.dtype == torch.bfloat16
    assert torch.equal(model(IDS), reference.to(torch.bfloat16)(IDS))


def test_hooks_do_not_stack(saved: tuple[TinyLM, Path]) -> None:
    _, folder = saved
    model = accel.dispatch_checkpoint(empty_lm(), folder, device_map={"": "disk"})
    with pytest.raises(RuntimeError, match=r"already has accel offload hooks.*remove_hooks"):
        accel.cpu_offload(model, execution_device="cpu")
    model = accel.cpu_offload(accel.remove_hooks(model), execution_device="cpu")
    with pytest.raises(RuntimeError, match="already has accel offload hooks"):
        accel.dispatch_checkpoint(model, folder, device_map={"": "cpu"})


def test_a_dtype_change_on_disk_writes_memmaps_with_an_index(saved: tuple[TinyLM, Path]) -> None:
    reference, folder = saved
    offload = folder / "offload"
    model = accel.dispatch_checkpoint(
        empty_lm(), folder, device_map={"": "disk"}, offload_dir=offload, dtype=torch.bfloat16
    )
    assert torch.equal(model(IDS), reference.to(torch.bfloat16)(IDS))
    index = json.loads((offload / "index.json").read_text())
    assert index["blocks.0.lin1.weight"] == {
        "file": "blocks.0.lin1.weight.dat",
        "offset": 0,
        "dtype": "BF16",
        "shape": [16, 16],
    }
    assert (offload / "blocks.0.lin1.weight.dat").stat().st_size == 16 * 16 * 2


def test_cpu_and_disk_offload_of_a_model_in_memory(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = TinyLM()
    want = reference(IDS)
    model = accel.cpu_offload(TinyLM(), execution_device="cpu")
    model.load_state_dict(reference.state_dict())  # loading into the CPU copies works too
    assert torch.equal(model(IDS), want)
    disk = accel.disk_offload(
        accel.remove_hooks(model), offload_dir=tmp_path, execution_device="cpu"
    )
    assert disk.blocks[1].lin2.weight.device.type == "meta"
    assert (tmp_path / "index.json").exists()
    assert torch.equal(disk(IDS), want)
    assert torch.equal(accel.remove_hooks(disk)(IDS), want)
    assert disk.head.weight is disk.embed.weight


def test_offloaded_weights_are_on_the_execution_device_only_during_the_forward() -> None:
    # "meta" stands in for an accelerator: the hooks move weights and inputs there and back.
    model = accel.cpu_offload(nn.Sequential(nn.Linear(3, 2), nn.ReLU()), execution_device="meta")
    seen: list[str] = []
    model[0].register_forward_pre_hook(lambda m, _: seen.append(m.weight.device.type))
    out = model(torch.ones(4, 3))
    assert (out.device.type, out.shape, seen) == ("meta", torch.Size([4, 2]), ["meta"])
    assert model[0].weight.device.type == "cpu"


def test_default_budgets_come_from_this_machine() -> None:
    plan = accel.infer_device_map(linears(3))
    assert plan == {"": 0 if torch.cuda.is_available() else "cpu"}


# ---- bad input ------------------------------------------------------------------------------


def test_missing_and_unexpected_keys_are_listed(saved: tuple[TinyLM, Path]) -> None:
    _, folder = saved
    state = load_file(folder / "model.safetensors")
    del state["blocks.1.lin2.bias"]
    state["extra.weight"] = torch.zeros(2)
    save_file(state, folder / "model.safetensors")
    with pytest.raises(
        ValueError,
        match=r"missing keys \['blocks.1.lin2.bias'\], unexpected keys \['extra.weight'\]",
    ):
        accel.dispatch_checkpoint(empty_lm(), folder, device_map={"": "cpu"})
    del state["extra.weight"]
    save_file({**state, "extra.weight": torch.zeros(2)}, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing keys \['blocks.1.lin2.bias'\]"):
        accel.dispatch_checkpoint(empty_lm(), folder, device_map={"": "cpu"}, strict=False)


def test_a_missing_buffer_is_refused_when_strict(saved: tuple[TinyLM, Path]) -> None:
    _, folder = saved
    state = load_file(folder / "model.safetensors")
    del state["blocks.0.shift"]  # persistent buffer; built real (not meta) by empty init
    save_file(state, folder / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"missing keys \['blocks.0.shift'\], unexpected keys \[\]"
    ):
        accel.dispatch_checkpoint(empty_lm(), folder, device_map={"": "cpu"})
    model = accel.dispatch_checkpoint(empty_lm(), folder, device_map={"": "cpu"}, strict=False)
    assert model.blocks[0].lin1.weight.device.type == "cpu"


def test_a_shape_mismatch_names_the_tensor_and_both_shapes(saved: tuple[TinyLM, Path]) -> None:
    _, folder = saved
    state = load_file(folder / "model.safetensors")
    state["blocks.2.lin1.weight"] = torch.zeros(16, 8)
    save_file(state, folder / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"'blocks.2.lin1.weight'.* has \[16, 8\] but the model has \[16, 16\]"
    ):
        accel.dispatch_checkpoint(empty_lm(), folder, device_map={"": "cpu"})


def test_an_offload_dir_that_is_not_writable(saved: tuple[TinyLM, Path]) -> None:
    _, folder = saved
    blocked = folder / "model.safetensors" / "offload"  # under a file: cannot be created
    with pytest.raises(ValueError, match=r"offload_dir='.*offload' is not writable"):
        accel.dispatch_checkpoint(empty_lm(), folder, device_map={"": "disk"}, offload_dir=blocked)
    with pytest.raises(ValueError, match="is not writable"):
        accel.disk_offload(nn.Linear(2, 2), offload_dir=blocked)


def test_a_dtype_change_to_disk_needs_an_offload_dir(saved: tuple[TinyLM, Path]) -> None:
    _, folder = saved
    with pytest.raises(ValueError, match="needs a copy; pass offload_dir"):
        accel.dispatch_checkpoint(empty_lm(), folder, device_map={"": "disk"}, dtype=torch.float16)


@pytest.mark.parametrize(
    ("device_map", "match"),
    [
        ({"embed": "cpu", "pos": "cpu"}, "no entry for 'blocks.0.shift'"),
        ({"": "cpu", "head": "disk"}, "'head.weight' is tied to 'embed.weight'"),
        ({"": "gpu"}, r"device_map\[''\]='gpu'"),
        ({"": "cpu", "blocks.9": "disk"}, r"names \['blocks.9'\], which are neither"),
        (
            {"": torch.cuda.device_count()},
            rf"accelerators \[{torch.cuda.device_count()}\] but this machine has",
        ),
    ],
)
def test_bad_device_maps(
    saved: tuple[TinyLM, Path], device_map: dict[str, int | str], match: str
) -> None:
    _, folder = saved
    with pytest.raises(ValueError, match=match):
        accel.dispatch_checkpoint(empty_lm(), folder, device_map=device_map)


def test_budgets_with_an_explicit_map_warn_that_they_are_ignored(
    saved: tuple[TinyLM, Path],
) -> None:
    _, folder = saved
    with pytest.warns(UserWarning, match="ignored with the device_map you passed"):
        accel.dispatch_checkpoint(empty_lm(), folder, device_map={"": "cpu"}, max_memory={0: 1})


def test_init_on_device_undoes_its_patch_on_error_and_remove_hooks_without_hooks() -> None:
    with pytest.raises(RuntimeError, match="boom"), accel.init_empty_weights():
        raise RuntimeError("boom")
    assert nn.Linear(2, 2).weight.device.type == "cpu"
    layer = nn.Linear(2, 2)
    assert accel.remove_hooks(layer) is layer


def test_a_missing_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        accel.dispatch_checkpoint(empty_lm(), tmp_path / "nope.safetensors")


# ---- a 1.5 GB checkpoint under a 1 GiB CPU budget --------------------------------------------

LAYERS, WIDTH = 22, 4096  # 22 x 67 MB = 1.48 GB in fp32
CHILD = textwrap.dedent(
    """
    import json, resource, sys, torch, accel
    from torch import nn
    folder = sys.argv[1]
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    before = rss()
    with accel.init_empty_weights():
        model = nn.Sequential(*[nn.Linear({width}, {width}) for _ in range({layers})])
    model = accel.dispatch_checkpoint(
        model, folder, max_memory={{"cpu": 2**30}}, offload_dir=folder + "/offload"
    )
    x = torch.load(folder + "/x.pt")
    with torch.no_grad():
        out = model(x)
        again = model(x)
    torch.save({{"out": out, "again": again}}, folder + "/out.pt")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    plan = accel.infer_device_map(model, max_memory={{"cpu": 2**30, "disk": 2**62}})
    print(json.dumps({{"before": before, "peak": peak, "hwm": hwm, "plan": plan}}))
    """
)
# ru_maxrss of a process started by vfork/exec starts from the high-water mark of the process
# that started it; this parent holds the 1.5 GB model, so a small Python in between starts the
# measured process, whose ru_maxrss then only counts its own memory (and a few MB).
LAUNCHER = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"


@pytest.mark.slow
def test_a_big_checkpoint_dispatched_under_a_cpu_budget_stays_within_memory(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        layers = [nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]
        for i in range(0, LAYERS, 7):  # shards of 7 layers: ~470 MB each
            shard = {
                f"{j}.{n}": t for j in range(i, min(i + 7, LAYERS)) for n, t in
                layers[j].state_dict().items()
            }  # fmt: skip
            save_file(shard, tmp_path / f"part{i // 7}.safetensors")
        index = {
            "weight_map": {
                f"{j}.{n}": f"part{j // 7}.safetensors"
                for j in range(LAYERS)
                for n in ("weight", "bias")
            }
        }
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
        x = torch.randn(2, WIDTH)
        torch.save(x, tmp_path / "x.pt")
        want = nn.Sequential(*layers)(x)
    largest_shard = max(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    del layers
    run = subprocess.run(
        [sys.executable, "-c", LAUNCHER, sys.executable, "-c", CHILD.format(width=WIDTH,
         layers=LAYERS), str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    got = torch.load(tmp_path / "out.pt")
    assert torch.equal(got["out"], want) and torch.equal(got["again"], want)
    assert "disk" in report["plan"].values() and "cpu" in report["plan"].values()
    limit = 1.1 * (2**30 + largest_shard)
    for peak in (report["peak"], report["hwm"]):  # ru_maxrss, and the kernel's VmHWM
        assert peak - report["before"] <= limit, (peak / 2**20, report["before"] / 2**20)
    for shard in tmp_path.glob("*.safetensors"):  # 1.5 GB: do not leave it in pytest's tmp
        shard.unlink()
