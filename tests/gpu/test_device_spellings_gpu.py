"""`init_distributed(device=...)` with every spelling a user writes, on a real GPU (issue 34).

On the H200, `device="cuda"` raised torch's "Expected a torch.device with a specified index or
an integer, but got:cuda" from `torch.cuda.set_device`. Under --gpu-dry-run (no GPU) each
spelling must instead say, in one line, that this machine has no CUDA GPU.
"""

from __future__ import annotations

import pytest
import torch

from accel import init_distributed, shutdown

SPELLINGS = ["cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0), 0]


@pytest.mark.parametrize("spelling", SPELLINGS, ids=repr)
def test_every_spelling_of_this_ranks_gpu(device: torch.device, spelling: object) -> None:
    if device.type == "cpu":  # the dry run: the same call on a machine without a GPU
        with pytest.raises(ValueError, match="this machine has no CUDA GPU") as err:
            init_distributed(device=spelling)  # type: ignore[arg-type]
        assert "\n" not in str(err.value)
        return
    ctx = init_distributed(device=spelling)  # type: ignore[arg-type]
    try:
        assert ctx.device == torch.device("cuda", 0)  # a plain process is local rank 0
        assert torch.cuda.current_device() == 0
        x = torch.ones(2, device=ctx.device)
        assert x.device == ctx.device
    finally:
        shutdown(ctx)


def test_the_last_gpu_and_one_past_it(device: torch.device) -> None:
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if count:
        last = count - 1
        for spelling in (f"cuda:{last}", torch.device("cuda", last), last):
            assert init_distributed(device=spelling).device == torch.device("cuda", last)
        torch.cuda.set_device(0)  # as the other tests of this session expect
    with pytest.raises(ValueError) as err:
        init_distributed(device=f"cuda:{count}")
    message = str(err.value)
    assert "\n" not in message and f"device='cuda:{count}'" in message
    if count:
        assert f"names GPU {count} but this machine has {count} GPU" in message
        assert "device='cuda'" in message


def test_the_accel_device_variable(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_DEVICE", "cuda")
    if device.type == "cpu":
        with pytest.raises(ValueError, match=r"^init_distributed: ACCEL_DEVICE='cuda' names"):
            init_distributed()
        return
    ctx = init_distributed()
    assert ctx.device == torch.device("cuda", 0)
    assert ctx.sources["device"] == "env ACCEL_DEVICE"
