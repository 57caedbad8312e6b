"""describe_device_map: the map dispatch_checkpoint chose, as a table per device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import accel


def _bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def test_the_table_of_a_dispatched_model(tmp_path: Path) -> None:
    real = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])
    save_file(real.state_dict(), tmp_path / "model.safetensors")
    with accel.init_empty_weights():
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])
    budget = {"cpu": 3 * _bytes(real[0]) + 10}
    model = accel.dispatch_checkpoint(
        model, tmp_path / "model.safetensors", device_map="sequential", max_memory=budget,
        offload_dir=tmp_path / "offload",
    )  # fmt: skip
    table = accel.describe_device_map(model, max_memory=budget).splitlines()
    assert table[:2] == ["| device | modules | bytes | share of budget |", "|---|---|---|---|"]
    placed: dict[object, list[str]] = {}
    for name, device in model.hf_device_map.items():
        placed.setdefault(device, []).append(name)
    assert set(placed) == {"cpu", "disk"}  # the budget holds some layers, not all
    expected = []
    for device in ("cpu", "disk"):
        names = placed[device]
        total = sum(_bytes(real.get_submodule(n)) for n in names)
        share = (
            f"{100 * total / budget['cpu']:.1f}% of {budget['cpu']} B"
            if device == "cpu"
            else "no limit"
        )
        expected.append(f"| {device} | {len(names)}: {', '.join(names)} | {total} B | {share} |")
    assert table[2:] == expected


def test_long_name_lists_are_cut_and_a_model_without_a_map_is_refused() -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(40)])
    mapping = {str(i): 0 if i < 30 else "cpu" for i in range(40)}
    rows = accel.describe_device_map(model, device_map=mapping, max_memory={0: 2**20, "cpu": 2**30})
    gpu, cpu = rows.splitlines()[2:]
    assert gpu.startswith("| 0 | 30: 0, 1, 2,") and "more) | 720 B | 0.1% of 1.00 MiB |" in gpu
    assert cpu == "| cpu | 10: 30, 31, 32, 33, 34, 35, 36, 37, 38, 39 | 240 B | 0.0% of 1.00 GiB |"
    with pytest.raises(
        ValueError, match="describe_device_map: device_map=None and the model has no"
    ):
        accel.describe_device_map(model)
