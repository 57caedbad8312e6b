"""Tokens/s and MFU against a hand computation and against torch's own FLOP counter."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from accel import JSONLTracker, RunContext, log_metrics, num_flops_per_token, throughput_metrics


class _Block(nn.Module):
    """Attention written as explicit matmuls (so torch's counter sees every one) plus an MLP,
    all Linear layers without bias: every parameter is a matmul weight."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)).softmax(-1)
        x = x + self.out((scores @ v).transpose(1, 2).reshape(b, s, d))
        return x + self.down(self.up(x).relu())


def test_flops_per_token_equals_torchs_count_of_a_training_step() -> None:
    # An independent reference: torch's FlopCounterMode counts the matmuls of a real forward
    # and backward; the 6N + 12 L H D S estimate must match it exactly for this model.
    num_layers, num_heads, head_dim, batch, seq_len = 3, 4, 8, 2, 16
    dim = num_heads * head_dim
    model = nn.Sequential(*[_Block(dim, num_heads) for _ in range(num_layers)])
    # As after an embedding, the input needs its gradient, so the first layer's backward has
    # both matmuls like every other.
    x = torch.randn(batch, seq_len, dim, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    num_params = sum(p.numel() for p in model.parameters())
    estimate = num_flops_per_token(
        num_params, num_layers=num_layers, num_heads=num_heads, head_dim=head_dim, seq_len=seq_len
    )
    assert estimate * batch * seq_len == counter.get_total_flops()


def test_throughput_metrics_by_hand() -> None:
    # A 124M-parameter model, 8 sequences of 1024 tokens in 0.25 s on a 312 TFLOP/s device.
    per_token = num_flops_per_token(124_000_000)
    assert per_token == 744_000_000
    metrics = throughput_metrics(
        step_time_s=0.25, num_tokens=8 * 1024, flops_per_token=per_token, peak_flops=312e12
    )
    assert metrics.keys() == {"tokens_per_s", "tflops_per_s", "mfu"}
    assert metrics["tokens_per_s"] == 32768.0
    assert metrics["tflops_per_s"] == pytest.approx(32768 * 744e6 / 1e12)
    assert metrics["mfu"] == pytest.approx(32768 * 744e6 / 312e12)
    assert "mfu" not in throughput_metrics(step_time_s=1.0, num_tokens=0, flops_per_token=per_token)


def test_throughput_metrics_log_through_a_tracker(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    ctx = RunContext()
    metrics = throughput_metrics(
        step_time_s=0.5, num_tokens=1000, flops_per_token=6e6, peak_flops=1e12
    )
    with JSONLTracker(path) as tracker:
        log_metrics(ctx, metrics, step=3, trackers=[tracker])
    (record,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert record == {"step": 3, "tokens_per_s": 2000.0, "tflops_per_s": 0.012, "mfu": 0.012}


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: num_flops_per_token(0), r"num_params=0 must be an int >= 1"),
        (lambda: num_flops_per_token(10, seq_len=-1), r"seq_len=-1 must be an int >= 0"),
        (lambda: num_flops_per_token(10.0), r"num_params=10.0 must be an int"),  # type: ignore[arg-type]
        (
            lambda: throughput_metrics(step_time_s=0, num_tokens=1, flops_per_token=1.0),
            r"throughput_metrics: step_time_s=0 must be a finite number > 0",
        ),
        (
            lambda: throughput_metrics(step_time_s=1, num_tokens=1, flops_per_token=math.nan),
            r"flops_per_token=nan must be a finite number > 0",
        ),
        (
            lambda: throughput_metrics(
                step_time_s=1, num_tokens=1, flops_per_token=1.0, peak_flops=-1.0
            ),
            r"peak_flops=-1.0 must be a finite number > 0",
        ),
        (
            lambda: throughput_metrics(step_time_s=1, num_tokens=True, flops_per_token=1.0),
            r"num_tokens=True must be an int >= 0",
        ),
    ],
)
def test_bad_inputs_name_the_argument(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()  # type: ignore[operator]
