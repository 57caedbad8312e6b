"""The planner follows Accelerate's `infer_auto_device_map` rules, scenario by scenario.

The models and budgets mirror Accelerate's own tests (tests/test_modeling_utils.py:
`test_infer_auto_device_map`, `..._with_tied_weights`, `..._with_buffer_check`,
`..._with_buffer_check_and_multi_devices`, `test_get_balanced_memory`); each expected map is
worked out from its rules, stated once here:

- devices fill in order: accelerators by index, "cpu", then "disk" (always there, unlimited);
- the first accelerator and "cpu" keep room for the largest layer still to place (a layer: a
  module without children, or of a no-split class), to run offloaded layers;
- a module that does not fit is split into its own parameters and children (never a no-split
  class); one that cannot split sends planning on to the next device;
- a module is placed together with the modules holding the other names of its tied weights;
- at the end, children that all landed on one device are merged back under their parent's name.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_model
from torch import nn

import accel
from tests.models import LinearBNLinear, LinearWithSub


def three(tie: int = 0) -> nn.Sequential:
    model = nn.Sequential(
        OrderedDict((f"layer{i}", LinearBNLinear()) for i in (1, 2, 3))  # 236 B each
    )
    if tie >= 1:
        model.layer3.linear2.weight = model.layer1.linear2.weight
    if tie >= 2:
        model.layer2.linear2.weight = model.layer1.linear2.weight
    if tie >= 3:
        model.layer2.linear1.weight = model.layer1.linear1.weight
    return model


def plan(model: nn.Module, max_memory: dict[int | str, int | str], **kw: object) -> object:
    return accel.infer_device_map(model, max_memory=max_memory, **kw)  # type: ignore[arg-type]


def test_room_for_the_largest_layer_is_kept_on_the_first_accelerator() -> None:
    # Device 0 keeps 100 B for linear2, so only linear1 (64) fits beside it.
    assert plan(LinearBNLinear(), {0: 200, 1: 200}) == {
        "linear1": 0,
        "batchnorm": 1,
        "linear2": 1,
    }


def test_later_accelerators_keep_no_room() -> None:
    # batchnorm + linear2 = 172 B fill device 1 exactly: no reserve there.
    assert plan(LinearBNLinear(), {0: 200, 1: 172, 2: 200}) == {
        "linear1": 0,
        "batchnorm": 1,
        "linear2": 1,
    }


def test_a_tie_that_shrinks_the_model_lets_it_fit_whole() -> None:
    model = LinearBNLinear()
    # linear1 now holds linear2's 80 B weight (96 B in all), linear2 only its bias (20 B): 188
    # B. When linear1, the largest layer, is placed, the room kept is the next largest (72 B).
    model.linear1.weight = model.linear2.weight
    assert plan(model, {0: 200, 1: 200}) == {"": 0}


def test_modules_split_at_the_layer_level() -> None:
    model = nn.Sequential(LinearBNLinear(), LinearBNLinear(), LinearBNLinear())
    assert plan(model, {0: 500, 1: 500}) == {
        "0": 0,
        "1.linear1": 0,
        "1.batchnorm": 0,
        "1.linear2": 1,
        "2": 1,
    }


def test_no_split_classes_move_whole() -> None:
    model = nn.Sequential(LinearBNLinear(), LinearBNLinear(), LinearBNLinear())
    for no_split in (["LinearBNLinear"], [LinearBNLinear]):
        assert plan(model, {0: 500, 1: 500}, no_split=no_split) == {"0": 0, "1": 1, "2": 1}


def test_a_tied_module_is_placed_with_the_first_of_its_group() -> None:
    assert plan(three(tie=1), {0: 400, 1: 500}) == {
        "layer1": 0,
        "layer3.linear2": 0,
        "layer2": 1,
        "layer3.linear1": 1,
        "layer3.batchnorm": 1,
    }


def test_a_weight_shared_by_three_modules() -> None:
    assert plan(three(tie=2), {0: 400, 1: 500}) == {
        "layer1": 0,
        "layer2.linear2": 0,
        "layer3.linear2": 0,
        "layer2.linear1": 1,
        "layer2.batchnorm": 1,
        "layer3.linear1": 1,
        "layer3.batchnorm": 1,
    }


def test_two_tied_groups() -> None:
    assert plan(three(tie=3), {0: 400, 1: 500}) == {
        "layer1": 0,
        "layer2.linear1": 0,
        "layer2.linear2": 0,
        "layer3.linear2": 0,
        "layer2.batchnorm": 1,
        "layer3.linear1": 1,
        "layer3.batchnorm": 1,
    }


def test_ties_inside_one_sequential() -> None:
    model = nn.Sequential(
        OrderedDict(
            linear1=nn.Linear(4, 4), linear2=nn.Linear(6, 6), linear3=nn.Linear(4, 4),
            linear4=nn.Linear(6, 6),
        )
    )  # fmt: skip
    model.linear3.weight = model.linear1.weight
    model.linear3.bias = model.linear1.bias
    assert plan(model, {0: 250, 1: 400}) == {
        "linear1": 0,
        "linear2": 1,
        "linear3": 0,
        "linear4": 1,
    }


def test_a_tie_whose_name_prefixes_another() -> None:
    model = nn.Sequential(OrderedDict(compute=LinearWithSub()))
    assert plan(model, {0: 4, "cpu": 96000}) == {"": "cpu"}


def with_buffers(extra_layer: bool = False) -> LinearBNLinear:
    model = LinearBNLinear()
    model.linear1.register_buffer("test_buffer1", torch.zeros(10, 2))  # linear1: 144 B
    model.batchnorm.register_buffer("test_buffer2", torch.zeros(10, 3))  # batchnorm: 192 B
    model.linear2.register_buffer("test_buffer3", torch.zeros(10, 3))  # linear2: 220 B
    if extra_layer:
        model.linear3 = nn.Linear(4, 5)
        model.linear3.register_buffer("test_buffer4", torch.zeros(10, 2))  # 180 B
    return model


def test_buffers_count_with_their_module() -> None:
    assert plan(with_buffers(), {0: 400, "cpu": "1GB"}) == {
        "linear1": 0,
        "batchnorm": "cpu",
        "linear2": "cpu",
    }


@pytest.mark.parametrize("second", [400, 200])
def test_buffers_with_two_accelerators(second: int) -> None:
    assert plan(with_buffers(extra_layer=True), {0: 400, 1: second, "cpu": "1GB"}) == {
        "linear1": 0,
        "batchnorm": 1,
        "linear2": "cpu",
        "linear3": "cpu",
    }


def test_disk_is_the_implicit_last_tier() -> None:
    # The CPU keeps 100 B for the largest layer (it runs disk layers): linear1 fits, no more.
    assert plan(LinearBNLinear(), {"cpu": 200}) == {
        "linear1": "cpu",
        "batchnorm": "disk",
        "linear2": "disk",
    }


def test_budgets_without_cpu_get_the_machines_ram_for_it() -> None:
    # As Accelerate's get_max_memory: 80% of the available RAM, so nothing goes to disk here.
    assert plan(LinearBNLinear(), {0: 150}) == {"": "cpu"}
    assert plan(LinearBNLinear(), {0: 150, "cpu": 0}) == {"": "disk"}


def test_a_cpu_only_budget_dispatches_the_rest_from_disk(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = LinearBNLinear().eval()
    save_model(reference, str(tmp_path / "model.safetensors"))
    with accel.init_empty_weights():
        model = LinearBNLinear()
    model = accel.dispatch_checkpoint(model.eval(), tmp_path, max_memory={"cpu": 200})
    assert model.hf_device_map == {"linear1": "cpu", "batchnorm": "disk", "linear2": "disk"}
    x = torch.randn(2, 3)
    assert torch.equal(model(x), reference(x))


# ---- balanced strategies (Accelerate's get_balanced_memory) -----------------------------------


def test_balanced_spreads_the_model_over_accelerators() -> None:
    # 236 B over two devices: 118 each plus 1.25 x the mean leaf module (78 B) = 215 B on
    # device 0; the last device keeps its whole budget. Sequentially, everything fits on 0
    # (placing the largest layer itself needs no room kept for it).
    model = LinearBNLinear()
    assert plan(model, {0: 300, 1: 300}) == {"": 0}
    assert plan(model, {0: 300, 1: 300}, strategy="balanced") == {
        "linear1": 0,
        "batchnorm": 1,
        "linear2": 1,
    }
    # Budgets already below the balanced share are kept as they are.
    assert plan(model, {0: 200, 1: 200}, strategy="balanced") == plan(model, {0: 200, 1: 200})


def test_balanced_low_0_keeps_the_first_accelerator_free() -> None:
    model = LinearBNLinear()
    assert plan(model, {0: 300, 1: 300}, strategy="balanced_low_0") == {"": 1}


def test_balanced_counts_only_accelerators_with_a_budget() -> None:
    model = LinearBNLinear()
    # Devices 1 and 2 share the model: 215 B on 1 (no room kept: device 0 is the first).
    assert plan(model, {0: 0, 1: 300, 2: 300}) == {"": 1}
    assert plan(model, {0: 0, 1: 300, 2: 300}, strategy="balanced") == {
        "linear1": 1,
        "batchnorm": 1,
        "linear2": 2,
    }


def test_an_unknown_strategy_is_refused() -> None:
    with pytest.raises(ValueError, match=r"strategy='fast'.*'balanced_low_0'"):
        plan(LinearBNLinear(), {0: 300}, strategy="fast")


# ---- budget strings parse as Accelerate parses them -------------------------------------------


def test_a_lowercase_b_means_bits() -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])  # 80 B each
    # "2KB" is 2000 bytes: everything fits. "2Kb" is 2000 bits = 250 bytes: 80 B kept for the
    # largest layer, two layers beside it.
    assert plan(model, {"cpu": "2KB"}) == {"": "cpu"}
    assert plan(model, {"cpu": "2Kb"}) == {"0": "cpu", "1": "cpu", "2": "disk", "3": "disk"}
    assert plan(model, {"cpu": "250"}) == plan(model, {"cpu": 250})
    assert plan(model, {"cpu": "0.25KB"}) == plan(model, {"cpu": 250})


def test_max_shard_size_reads_the_same_units(tmp_path: Path) -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])  # tensors of 64 and 16 B
    ctx = accel.RunContext.single()
    accel.save_model(ctx, model, tmp_path / "bytes", max_shard_size="1KB")
    accel.save_model(ctx, model, tmp_path / "bits", max_shard_size="1Kb")  # 125 bytes
    assert len(list((tmp_path / "bytes").glob("*.safetensors"))) == 1
    assert len(list((tmp_path / "bits").glob("*.safetensors"))) == 4


def test_dispatch_sets_hf_device_map(tmp_path: Path) -> None:
    save_model(LinearBNLinear(), str(tmp_path / "model.safetensors"))
    with accel.init_empty_weights():
        model = LinearBNLinear()
    device_map = {"linear1": "cpu", "batchnorm": "cpu", "linear2": "disk"}
    model = accel.dispatch_checkpoint(model, tmp_path, device_map=device_map)
    assert model.hf_device_map == device_map
