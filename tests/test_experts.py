"""Expert parallelism: what wrap_model refuses by name, in one process (no group needed)."""

from __future__ import annotations

import pytest
import torch

import accel
from accel import ExpertParallel, Parallelism, RunContext
from accel.parallel._experts import resolve_plan
from tests.models import EP_PLAN, MoELlama, swiglu_expert

EP2 = RunContext(rank=0, world_size=2, parallelism=Parallelism(ep=2))


def test_ep_needs_a_plan_and_a_plan_needs_ep() -> None:
    with pytest.raises(ValueError, match=r"ep=2 but ep_plan=None; name the experts modules"):
        accel.wrap_model(EP2, MoELlama())
    with pytest.raises(ValueError, match=r"ep_plan was given but .* has ep=1"):
        accel.wrap_model(RunContext(), MoELlama(), ep_plan=EP_PLAN)
    with pytest.raises(ValueError, match=r"ep_plan pattern 'layers\.\*\.ffn' names no module"):
        accel.wrap_model(EP2, MoELlama(), ep_plan={"layers.*.ffn": swiglu_expert})
    with pytest.raises(ValueError, match=r"ep_plan='auto' finds transformers' experts classes"):
        resolve_plan(MoELlama(), "auto", 2)
    with pytest.raises(TypeError, match=r"ep_plan\['layers.\*.moe.experts'\]=3 is not"):
        resolve_plan(MoELlama(), {"layers.*.moe.experts": 3}, 2)


def test_experts_ep_cannot_split_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"holds 3 experts, which ep=2 does not divide"):
        resolve_plan(MoELlama(num_experts=3), EP_PLAN, 2)
    with pytest.raises(ValueError, match=r"do not all stack num_experts=None experts on dim 0"):
        resolve_plan(MoELlama(), {"layers.*.moe": swiglu_expert}, 2)  # router + experts
    ctx = RunContext(rank=0, world_size=4, parallelism=Parallelism(ep=2, tp=2))
    with pytest.raises(NotImplementedError, match=r"ep=2 with tp=2 is not supported"):
        accel.wrap_model(ctx, MoELlama(), ep_plan=EP_PLAN, tp_plan={"output": "colwise"})
    with pytest.raises(ValueError, match=r"capacity_factor=0 must be a positive number"):
        ExpertParallel(capacity_factor=0)
    assert resolve_plan(MoELlama(), EP_PLAN, 2)[0][0] == "layers.0.moe.experts"
    assert torch.is_tensor(MoELlama().layers[0].moe.experts.w1)


def test_compile_with_sp_or_ep_is_refused_by_name() -> None:
    with pytest.raises(NotImplementedError, match=r"compile=True with sp=1, ep=2"):
        accel.wrap_model(EP2, MoELlama(), ep_plan=EP_PLAN, compile=True)
