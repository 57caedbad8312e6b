"""wrap_model on the device at world size 1: FSDP2 with a bf16 mixed-precision policy,
activation checkpointing, compile=True and "regional", against the same torch calls by hand."""

from __future__ import annotations

import pytest
import torch

from tests.gpu import plumbing

CASES = {
    "fsdp2-bf16": plumbing.WrapCase(),
    "fsdp2-bf16-checkpointing": plumbing.WrapCase(ac=True),
    "fsdp2-bf16-compile": plumbing.WrapCase(compile=True),
    "fsdp2-bf16-checkpointing-regional": plumbing.WrapCase(ac=True, compile="regional"),
}


def _compute_dtypes(model: torch.nn.Module) -> list[torch.dtype]:
    """Record the dtype the first block's first feed-forward Linear computes in."""
    seen: list[torch.dtype] = []
    linear = next(
        m for n, m in model.named_modules() if "layers.0." in n and n.endswith("feed_forward.w1")
    )
    linear.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    return seen


@pytest.mark.parametrize("name", list(CASES))
def test_wrap_model_losses_equal_the_hand_wired_model(device: torch.device, name: str) -> None:
    case = CASES[name]
    sizes = plumbing.llama_sizes(device)
    data = plumbing.tokens(sizes, steps=3)
    noise = plumbing.reduction_noise(device)
    torch._dynamo.reset()  # each case compiles its own graphs
    with plumbing.one_rank_group(device) as ctx:
        hand = plumbing.wrap_by_hand(ctx, plumbing.make_llama(sizes), case)
        mine = plumbing.wrap_with_accel(ctx, plumbing.make_llama(sizes), case)
        # Hooks inside a compiled region would change its graph: dtypes are read eagerly.
        dtypes = [] if case.compile else [_compute_dtypes(m) for m in (hand, mine)]
        expected = plumbing.train_losses(hand, data, device)
        losses = plumbing.train_losses(mine, data, device)
        torch.testing.assert_close(losses, expected, **noise)
        plumbing.assert_same_params(mine, hand, **plumbing.param_noise(device))
        weight = next(mine.parameters())
        assert weight.device == device and weight.dtype == torch.float32  # sharded fp32 master
    for seen in dtypes:
        assert seen and set(seen) == {torch.bfloat16}  # FSDP2's policy: bf16 compute
    assert all(torch.isfinite(torch.tensor(losses)))
