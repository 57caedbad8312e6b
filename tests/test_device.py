"""Every device spelling a user writes means what it means in torch (DESIGN.md principle 7).

`resolve_device` is the pure decision behind `init_distributed(device=...)` and
`ACCEL_DEVICE`: a spelling, this rank's local rank and the machine's GPU count give one indexed
device, so every spelling is checked here on a CPU at any simulated GPU count.
"""

from __future__ import annotations

import pytest
import torch

from accel import init_distributed
from accel._device import resolve_device

CUDA = torch.device("cuda")


@pytest.mark.parametrize("spelling", ["cuda", CUDA])
@pytest.mark.parametrize(("local_rank", "count", "index"), [(0, 1, 0), (1, 2, 1), (3, 4, 3)])
def test_cuda_without_an_index_is_this_ranks_local_gpu(
    spelling: str | torch.device, local_rank: int, count: int, index: int
) -> None:
    got = resolve_device(spelling, local_rank=local_rank, device_count=count)
    assert got == torch.device("cuda", index)


def test_one_visible_gpu_per_process_is_index_0_at_any_local_rank() -> None:
    # srun --gpus-per-task=1 (or CUDA_VISIBLE_DEVICES per rank): each process sees one GPU.
    got = resolve_device("cuda", local_rank=3, device_count=1)
    assert got == torch.device("cuda", 0)


@pytest.mark.parametrize("spelling", ["cuda:1", torch.device("cuda:1"), torch.device("cuda", 1), 1])
@pytest.mark.parametrize("local_rank", [0, 1])
def test_an_index_names_that_gpu_whatever_the_local_rank(
    spelling: str | torch.device | int, local_rank: int
) -> None:
    got = resolve_device(spelling, local_rank=local_rank, device_count=2)
    assert got == torch.device("cuda", 1)


@pytest.mark.parametrize(
    ("spelling", "expected"),
    [("cpu", torch.device("cpu")), (torch.device("cpu"), torch.device("cpu")),
     ("cpu:0", torch.device("cpu", 0)), ("mps", torch.device("mps")),
     ("meta", torch.device("meta"))],
)  # fmt: skip
def test_other_devices_are_torchs(spelling: str | torch.device, expected: torch.device) -> None:
    assert resolve_device(spelling, local_rank=1, device_count=0) == expected


@pytest.mark.parametrize(
    ("spelling", "shown"),
    [("cuda:2", "'cuda:2'"), (torch.device("cuda", 2), "device(type='cuda', index=2)"), (2, "2")],
)
def test_a_gpu_this_machine_lacks_is_one_line(spelling: object, shown: str) -> None:
    with pytest.raises(ValueError) as err:
        resolve_device(spelling, local_rank=0, device_count=2)  # type: ignore[arg-type]
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"init_distributed: device={shown} names GPU 2")
    assert "this machine has 2 GPUs (cuda:0 to cuda:1)" in message
    assert "device='cuda'" in message  # the fix: this rank's own GPU


@pytest.mark.parametrize("spelling", ["cuda", "cuda:0", 0])
def test_cuda_on_a_machine_without_gpus_is_one_line(spelling: object) -> None:
    with pytest.raises(ValueError) as err:
        resolve_device(spelling, local_rank=0, device_count=0)  # type: ignore[arg-type]
    message = str(err.value)
    assert "\n" not in message
    assert f"device={spelling!r}" in message
    assert "this machine has no CUDA GPU" in message and "device='cpu'" in message


def test_the_variable_is_named_when_the_spelling_came_from_it() -> None:
    with pytest.raises(ValueError, match=r"^init_distributed: ACCEL_DEVICE='cuda:5' names GPU 5"):
        resolve_device("cuda:5", local_rank=0, device_count=1, name="ACCEL_DEVICE")


@pytest.mark.parametrize("spelling", ["gpu", "0", "cuda:-1", "cuda:x", ""])
def test_a_string_torch_cannot_read_is_refused_by_name(spelling: str) -> None:
    with pytest.raises(ValueError, match=rf"^init_distributed: device={spelling!r} is not a "):
        resolve_device(spelling, local_rank=0, device_count=1)


@pytest.mark.parametrize("spelling", [-1, True, 1.0, ["cuda"]])
def test_other_values_are_refused(spelling: object) -> None:
    with pytest.raises((TypeError, ValueError), match=r"^init_distributed: device="):
        resolve_device(spelling, local_rank=0, device_count=1)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only answer")
@pytest.mark.parametrize("spelling", ["cuda", "cuda:0", torch.device("cuda"), 0])
def test_init_distributed_with_a_cuda_spelling_on_this_cpu_says_there_is_no_gpu(
    spelling: object,
) -> None:
    # Before the fix: torch's "Expected a torch.device with a specified index or an integer,
    # but got:cuda" (from torch.cuda.set_device), the very error of issue 34 on the H200.
    with pytest.raises(ValueError, match=r"this machine has no CUDA GPU") as err:
        init_distributed(device=spelling)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only answer")
def test_accel_device_variable_with_cuda_on_this_cpu_names_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ACCEL_DEVICE", "cuda")
    with pytest.raises(ValueError, match=r"^init_distributed: ACCEL_DEVICE='cuda' names"):
        init_distributed()
