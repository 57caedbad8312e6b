"""The device canary tells the run's device from the host on a CPU, as a GPU would."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accel
from accel.testing import device_canary

MIXED = r"device canary: .* on the host .*Expected all tensors to be on the same device"


def test_a_host_tensor_meeting_a_model_on_the_device_fails_as_on_a_gpu() -> None:
    with device_canary() as device:
        ctx = accel.RunContext.single()
        assert ctx.device == device == torch.device("cpu", 0)
        model = nn.Linear(4, 2).to(ctx.device)
        with pytest.raises(RuntimeError, match=MIXED + r".*device=ctx\.device"):
            model(torch.randn(8, 4))  # examples/test_my_step.py: mat1 is on cpu
        assert model(torch.randn(8, 4).to(ctx.device)).shape == (8, 2)
        assert model(torch.randn(8, 4, device=ctx.device)).shape == (8, 2)


def test_values_are_real_and_equal_to_the_plain_run() -> None:
    torch.manual_seed(0)
    model, x = nn.Linear(4, 2), torch.randn(8, 4)
    expected = F.mse_loss(model(x), torch.zeros(8, 2))
    with device_canary() as device:
        moved = copy.deepcopy(model).to(device)
        got = F.mse_loss(moved(x.to(device)), torch.zeros(8, 2, device=device))
        got.backward()
        assert moved.weight.grad is not None and moved.weight.grad.device == device
    assert torch.equal(got.detach(), expected.detach())


def test_a_mask_made_on_the_default_device_fails_in_the_transformer() -> None:
    # examples/char_lm.py: mask is on cpu, different from other tensors on cuda:0
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    with device_canary() as device:
        layer = layer.to(device)
        x = torch.randn(2, 5, 8, device=device)
        with pytest.raises(RuntimeError, match=MIXED):
            layer(x, src_mask=nn.Transformer.generate_square_subsequent_mask(5), is_causal=True)
        mask = nn.Transformer.generate_square_subsequent_mask(5, device=x.device)
        assert layer(x, src_mask=mask, is_causal=True).shape == (2, 5, 8)


def test_a_copy_left_on_the_host_fails_against_the_moved_model() -> None:
    # examples/causal_lm_accumulation.py: found at least two devices, cuda:0 and cpu
    with device_canary() as device:
        model = nn.Linear(3, 3)
        reference = copy.deepcopy(model)  # stays on the host
        model = model.to(device)
        with pytest.raises(RuntimeError, match=MIXED):
            [p - q for p, q in zip(model.parameters(), reference.parameters(), strict=True)]
        reference = reference.to(device)
        pairs = zip(model.parameters(), reference.parameters(), strict=True)
        assert all(torch.equal(p, q) for p, q in pairs)


def test_scalars_derived_devices_and_explicit_moves() -> None:
    with device_canary() as device:
        x = torch.ones(3, device=device)
        assert x.device == device and torch.ones(3).device == torch.device("cpu")
        assert (x * torch.tensor(2.0)).sum().item() == 6  # a 0-dim host tensor is a scalar
        assert (x + torch.arange(3, device=x.device)).tolist() == [1, 2, 3]
        assert (x + torch.zeros_like(x)).device == device
        with pytest.raises(RuntimeError, match=MIXED):
            x + x.cpu()
        with pytest.raises(RuntimeError, match=MIXED):
            x + x.to("cpu")
        assert (x.cpu() + torch.ones(3)).device == torch.device("cpu")
        with pytest.raises(RuntimeError, match=MIXED):
            torch.cat([x, torch.zeros(2)])
        with pytest.raises(TypeError, match=r"to numpy.*Use Tensor.cpu"):
            x.numpy()
        assert x.cpu().numpy().tolist() == [1, 1, 1]
        assert x.tolist() == [1, 1, 1] and x.sum().item() == 3


def test_indexing_follows_cuda() -> None:
    with device_canary() as device:
        on_device, on_host = torch.arange(6.0, device=device), torch.arange(6.0)
        assert on_device[torch.tensor([0, 2])].tolist() == [0, 2]  # host indices: allowed
        with pytest.raises(RuntimeError, match="indices should be either on cpu"):
            on_host[torch.tensor([0, 2], device=device)]


def test_outside_the_canary_nothing_changes() -> None:
    assert accel.RunContext.single(device="cpu").device == torch.device("cpu")
    if not torch.cuda.is_available():
        assert accel.RunContext.single().device == torch.device("cpu")
        assert accel.init_distributed().device == torch.device("cpu")
    nn.Linear(4, 2)(torch.randn(1, 4))


def test_init_distributed_picks_the_canary_as_it_would_a_gpu() -> None:
    with device_canary() as device:
        ctx = accel.init_distributed()
        assert ctx.device == device and ctx.sources["device"] == "default"
        assert accel.init_distributed(device="cpu").device == torch.device("cpu")


def test_the_launch_variable_is_one_or_zero() -> None:
    from accel_cli._worker import _canary

    with _canary("1"):
        assert accel.RunContext.single().device == torch.device("cpu", 0)
    with _canary("0"):
        assert accel.RunContext.single(device="cpu").device == torch.device("cpu")
    with pytest.raises(ValueError, match=r"ACCEL_DEVICE_CANARY='maybe' must be 1 or 0"):
        _canary("maybe")


ALL_REDUCE = """
import sys
import torch
import torch.distributed as dist
import accel

ctx = accel.init_distributed(backend=sys.argv[1] or None)
dist.all_reduce(torch.ones(2))  # a host tensor, which NCCL refuses
sys.stdout.write(f"rank {ctx.rank} reduced\\n")  # one write: the ranks share the pipe
"""


@pytest.mark.slow
def test_a_launched_script_meets_the_nccl_rule_where_accel_picked_the_backend(
    tmp_path: Path,
) -> None:
    from tests.cli.test_cli import accel_cli

    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    canary = {"ACCEL_DEVICE_CANARY": "1"}
    picked = accel_cli(tmp_path, "launch", "--num_processes", "2", str(script), "", env=canary)
    assert picked.returncode == 1, picked.stdout
    assert "No backend type associated with device type cpu" in picked.stderr
    # a backend the script names keeps its own rules: gloo takes host tensors on a GPU machine
    named = accel_cli(tmp_path, "launch", "--num_processes", "2", str(script), "gloo", env=canary)
    assert named.returncode == 0, named.stderr[-2000:]
    assert sorted(named.stdout.splitlines()) == ["rank 0 reduced", "rank 1 reduced"]
