"""wrap_model on the device at world size 1: FSDP2 with a bf16 mixed-precision policy,
activation checkpointing, compile=True and "regional", against the same torch calls by hand."""

from __future__ import annotations

import pytest
import torch

from tests.gpu import plumbing

# Dynamo reads `.grad` of FSDP2's unsharded (non-leaf) parameters while tracing, which warns.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning"
)

CASES = {
    "fsdp2-bf16": plumbing.WrapCase(),
    "fsdp2-bf16-checkpointing": plumbing.WrapCase(ac=True),
    "fsdp2-bf16-compile": plumbing.WrapCase(compile=True),
    "fsdp2-bf16-checkpointing-regional": plumbing.WrapCase(ac=True, compile="regional"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_wrap_model_losses_equal_the_hand_wired_model(device: torch.device, name: str) -> None:
    case = CASES[name]
    sizes = plumbing.llama_sizes(device)
    data = plumbing.tokens(sizes, steps=3)
    torch._dynamo.reset()  # each case compiles its own graphs
    with plumbing.one_rank_group(device) as ctx:
        hand = plumbing.wrap_by_hand(ctx, plumbing.make_llama(sizes), case)
        expected = plumbing.train_losses(hand, data, device)
        mine = plumbing.wrap_with_accel(ctx, plumbing.make_llama(sizes), case)
        losses = plumbing.train_losses(mine, data, device)
        assert losses == expected
        plumbing.assert_same_params(mine, hand)
        weight = next(mine.parameters())
        assert weight.device == device and weight.dtype == torch.float32  # sharded fp32 master
    assert losses[-1] < losses[0]
