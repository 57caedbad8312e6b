"""Checkpoints of device tensors: an exact resume (device RNG included), a load into an FSDP2
model on the device, and save_model from the device equal to the CPU save byte for byte."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

import accel
from tests.gpu import plumbing
from tests.models import Block, lm_loss

WIDTH = 64


def _model(device: torch.device, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(WIDTH, 4 * WIDTH), nn.Dropout(0.1), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)]
    return nn.Sequential(*layers).to(device)


def _steps(device: torch.device, model: nn.Module, opt: torch.optim.Optimizer, n: int) -> list:
    """Steps whose inputs and dropout masks come from the device's own RNG."""
    losses = []
    for _ in range(n):
        loss = model(torch.randn(16, WIDTH, device=device)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses).cpu().tolist()


def test_resumed_run_is_bit_identical(device: torch.device, tmp_path: Path) -> None:
    ctx = accel.RunContext.single(device=device)
    accel.set_seed(0)
    model = _model(device, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _steps(device, model, opt, 2)
    accel.save_state(ctx, tmp_path / "state", model=model, optimizer=opt)
    expected = _steps(device, model, opt, 3)

    torch.manual_seed(123)  # every generator, the device's included, moves elsewhere
    resumed = _model(device, seed=1)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    accel.load_state(ctx, tmp_path / "state", model=resumed, optimizer=resumed_opt)
    moments = [s["exp_avg"] for s in resumed_opt.state.values()]
    assert moments and all(m.device == device for m in moments)
    assert _steps(device, resumed, resumed_opt, 3) == expected
    plumbing.assert_same_params(resumed, model)


def test_load_checkpoint_in_fsdp2_model_on_the_device(device: torch.device, tmp_path: Path) -> None:
    sizes = plumbing.llama_sizes(device)
    reference = plumbing.make_llama(sizes, seed=5)
    accel.save_model(accel.RunContext.single(device="cpu"), reference, tmp_path)
    batch = plumbing.tokens(sizes, steps=1)[0].to(device)
    with plumbing.one_rank_group(device) as ctx:
        model = accel.wrap_model(
            ctx, plumbing.make_llama(sizes, seed=9), strategy="fsdp2",
            fsdp=accel.FSDPOptions(layer_classes=(Block,)),
        )  # fmt: skip
        result = accel.load_checkpoint_in_model(model, tmp_path)
        assert result == accel.LoadResult([], [])
        assert all(p.device == device for p in model.parameters())
        plumbing.assert_same_params(model, reference)
        with torch.no_grad():
            loss = lm_loss(model, batch)
    with torch.no_grad():
        expected = lm_loss(reference.to(device), batch)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_save_model_from_the_device_equals_the_cpu_save(
    device: torch.device, tmp_path: Path
) -> None:
    model = plumbing.make_gpt2(plumbing.gpt2_shape(device))
    on_cpu = copy.deepcopy(model)
    shard = "100MB" if plumbing.on_gpu(device) else "200KB"
    accel.save_model(accel.RunContext.single(device=device), model.to(device), tmp_path / "dev",
                     max_shard_size=shard)  # fmt: skip
    accel.save_model(accel.RunContext.single(device="cpu"), on_cpu, tmp_path / "cpu",
                     max_shard_size=shard)  # fmt: skip
    names = sorted(p.name for p in (tmp_path / "cpu").iterdir())
    assert sorted(p.name for p in (tmp_path / "dev").iterdir()) == names
    assert sum(n.endswith(".safetensors") for n in names) > 1
    for name in names:
        assert (tmp_path / "dev" / name).read_bytes() == (tmp_path / "cpu" / name).read_bytes()
