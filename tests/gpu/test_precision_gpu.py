"""bf16 autocast and fp16 with make_scaler on the device, against the torch.amp loop by hand."""

from __future__ import annotations

import pytest
import torch

from tests.gpu import plumbing

STEPS, WIDTH = 6, 64


def test_bf16_autocast_steps_equal_the_torch_amp_loop(device: torch.device) -> None:
    data = plumbing.mlp_data(WIDTH, STEPS)
    hand, _, _ = plumbing.amp_by_hand(device, "bf16", data, WIDTH)
    mine, stepped, _, seen = plumbing.amp_with_accel(device, "bf16", data, WIDTH)
    assert seen == [torch.bfloat16] * STEPS  # the Linear ran in bf16 on the device
    assert stepped == [True] * STEPS
    assert next(mine.parameters()).device == device
    assert next(mine.parameters()).dtype == torch.float32  # fp32 weights under autocast
    plumbing.assert_same_params(mine, hand)


@pytest.mark.parametrize("inf_at", [2])
def test_fp16_scaler_skips_an_inf_step_and_halves_the_scale(
    device: torch.device, inf_at: int
) -> None:
    data = plumbing.mlp_data(WIDTH, STEPS, inf_at=inf_at)
    hand, hand_stepped, hand_scales = plumbing.amp_by_hand(device, "fp16", data, WIDTH)
    mine, stepped, scales, seen = plumbing.amp_with_accel(device, "fp16", data, WIDTH)
    assert seen == [torch.float16] * STEPS
    assert stepped == [i != inf_at for i in range(STEPS)] == hand_stepped
    assert scales == hand_scales
    assert scales[inf_at] == scales[inf_at - 1] / 2
    plumbing.assert_same_params(mine, hand)
    assert all(torch.isfinite(p).all() for p in mine.parameters())
