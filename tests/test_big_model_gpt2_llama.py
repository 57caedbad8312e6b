"""Big models shaped like the ones users load: GPT-2 (tied head, blocks in a ModuleList) and
Llama (untied head, fp32 rotary buffer not in the checkpoint), dispatched with maps that name
containers, in fp32 and bf16, against the same model loaded whole by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_model
from torch import nn

import accel
from tests.models import GPT2_124M, GPT2LMHead, ListModel, LlamaForCausalLM

IDS = torch.tensor([[1, 5, 7, 2, 30, 200, 17, 3], [0, 3, 3, 9, 31, 255, 64, 8]])


def _save(model: nn.Module, folder: Path) -> Path:
    save_model(model, str(folder / "model.safetensors"))  # the tied weight once
    return folder


@pytest.fixture
def gpt2(tmp_path: Path) -> tuple[GPT2LMHead, Path]:
    torch.manual_seed(0)
    model = GPT2LMHead()
    return model, _save(model, tmp_path)


@pytest.fixture
def llama(tmp_path: Path) -> tuple[LlamaForCausalLM, Path]:
    torch.manual_seed(0)
    model = LlamaForCausalLM()
    return model, _save(model, tmp_path)


def by_hand(cls: type[nn.Module], folder: Path, dtype: torch.dtype | None) -> nn.Module:
    """The reference: build on CPU, read the whole file, cast its floating tensors, assign."""
    model = cls()  # non-persistent buffers (the rotary table) as the model builds them
    state = load_file(folder / "model.safetensors")
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    if isinstance(model, GPT2LMHead):  # the tied weight is stored once, under either name
        tied = state.get("lm_head.weight", state.get("transformer.wte.weight"))
        state["lm_head.weight"] = state["transformer.wte.weight"] = tied
    model.load_state_dict(state, assign=True)
    if isinstance(model, GPT2LMHead):
        model.lm_head.weight = model.transformer.wte.weight
    return model


def empty(cls: type[nn.Module]) -> nn.Module:
    with accel.init_empty_weights():
        return cls()


# ---- item 1: a map entry naming a module that is never called --------------------------------


@pytest.mark.slow
def test_a_map_naming_a_module_list_runs_its_layers_from_disk(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = ListModel()
    _save(reference, tmp_path)
    ids = torch.tensor([[1, 2, 3]])
    model = accel.dispatch_checkpoint(
        empty(ListModel), tmp_path, device_map={"emb": "cpu", "layers": "disk"}
    )
    assert torch.equal(model(ids), reference(ids))
    assert model.layers[0].weight.device.type == "meta"  # back on disk after the forward
    accel.remove_hooks(model)
    assert torch.equal(model(ids), reference(ids))


@pytest.mark.slow
def test_gpt2_with_its_blocks_container_mapped_to_disk(gpt2: tuple[GPT2LMHead, Path]) -> None:
    reference, folder = gpt2
    device_map = {
        "transformer.wte": "cpu",
        "transformer.wpe": "cpu",
        "transformer.h": "disk",
        "transformer.ln_f": "cpu",
        "lm_head": "cpu",
    }
    model = accel.dispatch_checkpoint(empty(GPT2LMHead), folder, device_map=device_map)
    assert torch.equal(model(IDS), reference(IDS))
    assert model.hf_device_map == device_map


@pytest.mark.slow
def test_a_planned_map_that_sends_the_block_list_to_disk(gpt2: tuple[GPT2LMHead, Path]) -> None:
    reference, folder = gpt2
    # The CPU holds the embeddings and keeps room for one block; the blocks go to disk
    # together, and the planner names their nn.ModuleList (as Accelerate's does).
    model = accel.dispatch_checkpoint(
        empty(GPT2LMHead), folder, max_memory={"cpu": 300_000}, no_split=["GPT2Block"]
    )
    assert model.hf_device_map["transformer.h"] == "disk"
    with torch.no_grad():
        assert torch.equal(model(IDS), reference(IDS))


# ---- the equality of whole models, fp32 and bf16, part on disk --------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cls", [GPT2LMHead, LlamaForCausalLM], ids=["gpt2", "llama"])
def test_dispatched_with_part_on_disk_equals_the_model_loaded_whole(
    tmp_path: Path, cls: type[nn.Module], dtype: torch.dtype | None
) -> None:
    torch.manual_seed(0)
    folder = _save(cls(), tmp_path)
    reference = by_hand(cls, folder, dtype)
    size = accel.compute_module_sizes(empty(cls), dtype=dtype)[""]
    model = accel.dispatch_checkpoint(
        empty(cls),
        folder,
        max_memory={"cpu": size // 2},
        offload_dir=tmp_path / "offload",
        dtype=dtype,
    )
    assert "disk" in model.hf_device_map.values() and "cpu" in model.hf_device_map.values()
    with torch.no_grad():
        want = reference(IDS)
        assert torch.equal(model(IDS), want)
        assert torch.equal(model(IDS), want)


# ---- item 2: dtype casts the checkpoint's tensors, not the buffers the model built ------------


@pytest.mark.slow
def test_bf16_leaves_the_fp32_rotary_buffer_as_built(llama: tuple[LlamaForCausalLM, Path]) -> None:
    _, folder = llama
    reference = by_hand(LlamaForCausalLM, folder, torch.bfloat16)
    model = accel.dispatch_checkpoint(
        empty(LlamaForCausalLM), folder, device_map={"": "cpu"}, dtype=torch.bfloat16
    )
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(model(IDS), reference(IDS))


# ---- item 3: dtype strings, and load_checkpoint_in_model filling an empty model ---------------


def test_dtype_strings_are_accepted_as_accelerate_accepts_them(
    llama: tuple[LlamaForCausalLM, Path],
) -> None:
    _, folder = llama
    want = accel.infer_device_map(
        empty(LlamaForCausalLM), max_memory={"cpu": 10**5}, dtype=torch.bfloat16
    )
    for spelling in ("bfloat16", "torch.bfloat16"):
        got = accel.infer_device_map(
            empty(LlamaForCausalLM), max_memory={"cpu": 10**5}, dtype=spelling
        )
        assert got == want
    sizes = accel.compute_module_sizes(empty(LlamaForCausalLM), dtype="float16")
    assert sizes == accel.compute_module_sizes(empty(LlamaForCausalLM), dtype=torch.float16)
    model = accel.dispatch_checkpoint(
        empty(LlamaForCausalLM), folder, device_map={"": "cpu"}, dtype="bfloat16"
    )
    assert model.lm_head.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", ["bfloat17", "cuda", 3])
def test_a_dtype_that_is_not_one_is_refused_by_name(
    llama: tuple[LlamaForCausalLM, Path], dtype: object
) -> None:
    _, folder = llama
    with pytest.raises((ValueError, TypeError), match=r"dtype=.*(float32|bfloat16)"):
        accel.dispatch_checkpoint(empty(LlamaForCausalLM), folder, dtype=dtype)  # type: ignore[arg-type]


@pytest.mark.slow
def test_load_checkpoint_in_model_fills_an_empty_model(gpt2: tuple[GPT2LMHead, Path]) -> None:
    reference, folder = gpt2
    model = empty(GPT2LMHead)
    accel.load_checkpoint_in_model(model, folder)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    with torch.no_grad():
        assert torch.equal(model(IDS), reference(IDS))
    again = empty(GPT2LMHead)
    accel.load_checkpoint_in_model(again, folder, device="cpu")
    with torch.no_grad():
        assert torch.equal(again(IDS), reference(IDS))


def test_load_checkpoint_in_model_refuses_to_leave_meta_tensors(
    llama: tuple[LlamaForCausalLM, Path],
) -> None:
    _, folder = llama
    with accel.init_empty_weights(include_buffers=True):
        model = LlamaForCausalLM()  # inv_freq on meta too: no checkpoint holds it
    with pytest.raises(ValueError, match=r"load_checkpoint_in_model: .*inv_freq.*meta"):
        accel.load_checkpoint_in_model(model, folder)


# ---- item 2: casting while loading holds no second copy of the checkpoint --------------------

PEAK_CHILD = """
import json, sys, torch, accel
from torch import nn
def vm(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
with accel.init_empty_weights():
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)])
start = vm("VmRSS")
model = accel.dispatch_checkpoint(model, sys.argv[1], device_map={"": "cpu"}, dtype="bfloat16")
print(json.dumps({"start": start, "peak": vm("VmHWM"), "end": vm("VmRSS")}))
"""


@pytest.mark.slow
def test_a_bf16_load_of_an_fp32_checkpoint_peaks_at_the_bf16_weights(tmp_path: Path) -> None:
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)])  # 134 MB in fp32
    save_model(model, str(tmp_path / "model.safetensors"))
    bf16 = sum(p.numel() * 2 for p in model.parameters())
    del model
    run = subprocess.run(
        [sys.executable, "-c", PEAK_CHILD, str(tmp_path)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    # The weights in bf16 (67 MB) plus what one chunk and the allocator take; mapping the fp32
    # file whole while casting would add its 134 MB.
    assert report["peak"] - report["start"] <= 1.3 * bf16, (report, bf16)


# ---- item 5 of the GPU run: GPT-2 124M over a GPU budget smaller than its embedding ----------


def test_gpt2_124m_over_a_small_gpu_budget_runs_its_offloaded_modules_on_the_gpu() -> None:
    """{0: "120MB", "cpu": "20GB"}: the tied embedding (154 MB in fp32) fits no GPU budget, so
    the whole model is offloaded; it must still run on GPU 0, with wte and lm_head together.
    Before, the map held no accelerator, the model was loaded to the CPU unhooked, and the
    first forward of GPU inputs failed (`index is on cuda:0, ... cpu (index_select)`)."""
    from accel.big_model import _device_map, _dispatch, _planner

    model = empty(partial(GPT2LMHead, GPT2_124M))  # type: ignore[arg-type]
    budgets = _device_map.budgets("test", {0: "120MB", "cpu": "20GB"})
    device_map = accel.infer_device_map(
        model, max_memory=budgets, no_split=["GPT2Block"], strategy="balanced"
    )
    _dispatch.Layout(model).place("test", device_map)  # refuses tied weights split apart
    unit = partial(_dispatch._unit_of, device_map=device_map)
    assert device_map[unit("lm_head.weight")] == device_map[unit("transformer.wte.weight")]
    offloaded = [n for n, _ in model.named_parameters() if device_map[unit(n)] in ("cpu", "disk")]
    assert offloaded  # the embedding at least
    assert _planner.execution_index(device_map, budgets) == 0
    if not torch.cuda.is_available():  # the planned GPU is named, not silently replaced
        with pytest.raises(ValueError, match=r"gives accelerator 0 memory, so the offloaded"):
            _dispatch.execution_device(device_map, budgets)


def test_a_planned_map_offloaded_whole_is_hooked_layer_by_layer(
    gpt2: tuple[GPT2LMHead, Path],
) -> None:
    """A budget that fits nothing gives {"": "disk"}; each block (no_split) and each other
    module with weights gets its own hook, so the execution device holds one layer's weights
    at a time, not the whole model's (as the single unit "" did)."""
    from accel.big_model._hooks import ATTR

    reference, folder = gpt2
    model = accel.dispatch_checkpoint(
        empty(GPT2LMHead), folder, max_memory={"cpu": 1}, no_split=["GPT2Block"]
    )
    assert model.hf_device_map == {"": "disk"}
    hooked = {n for n, m in model.named_modules() if hasattr(m, ATTR)}
    blocks = {f"transformer.h.{i}" for i in range(12)}
    assert hooked == {"transformer.wte", "transformer.wpe", "transformer.ln_f", "lm_head"} | blocks
    with torch.no_grad():
        assert torch.equal(model(IDS), reference(IDS))
    assert model.lm_head.weight is model.transformer.wte.weight  # tied between forwards too
    accel.remove_hooks(model)
