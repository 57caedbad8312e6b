"""DDPOptions' communication-hook settings, checked without a process group."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

import accel
from accel import DDPOptions, Parallelism, RunContext
from accel.parallel._ddp import comm_hook_state_and_fn
from tests.models import make_model


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"comm_hook": "power_sgd"}, r"comm_hook='power_sgd' is not supported; expected one of "
         r"\('fp16', 'bf16', 'powersgd', 'batched_powersgd'\).*comm_hook='powersgd'"),
        ({"comm_hook": "fp16", "comm_wrapper": "fp8"}, r"comm_wrapper='fp8' is not supported"),
        ({"comm_wrapper": "fp16"}, r"comm_wrapper='fp16' wraps a hook but comm_hook=None"),
        ({"comm_hook": "powersgd", "powersgd_rank": 0}, r"powersgd_rank=0 must be >= 1"),
        ({"comm_hook": "powersgd", "powersgd_start_iter": 1},
         r"powersgd_start_iter=1 must be >= 2"),
    ],
)  # fmt: skip
def test_bad_hook_settings_name_the_value(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DDPOptions(**kwargs)


def test_a_hook_under_another_strategy_is_refused_by_name() -> None:
    ctx = RunContext(rank=0, world_size=2, parallelism=Parallelism(dp_shard=2))
    with pytest.raises(
        ValueError, match=r"ddp=DDPOptions\(comm_hook='bf16'\) is a DDP communication hook but "
        r"strategy='auto' applies 'fsdp2'"
    ):  # fmt: skip
        accel.wrap_model(ctx, make_model(), ddp=DDPOptions(comm_hook="bf16"))
    with pytest.raises(ValueError, match=r"comm_hook='fp16'\) is a DDP communication hook"):
        accel.wrap_model(RunContext(), make_model(), ddp=DDPOptions(comm_hook="fp16"))


def test_names_map_to_torch_hooks_with_the_powersgd_state() -> None:
    group = object()
    assert comm_hook_state_and_fn(DDPOptions(), group) is None
    assert comm_hook_state_and_fn(DDPOptions(comm_hook="fp16"), group) == (
        group, default_hooks.fp16_compress_hook
    )  # fmt: skip
    assert comm_hook_state_and_fn(DDPOptions(comm_hook=default_hooks.allreduce_hook), group) == (
        group, default_hooks.allreduce_hook
    )  # fmt: skip
    hook = comm_hook_state_and_fn(
        DDPOptions(comm_hook="powersgd", powersgd_rank=4, powersgd_start_iter=10), None
    )
    assert hook is not None
    state, fn = hook
    assert fn is powerSGD_hook.powerSGD_hook
    assert isinstance(state, powerSGD_hook.PowerSGDState)
    assert (state.matrix_approximation_rank, state.start_powerSGD_iter) == (4, 10)


def test_batched_powersgd_is_refused_where_torch_cannot_run_it() -> None:
    # torch 2.13's batched_powerSGD_hook passes a 2-D matrix to _orthogonalize, which asserts
    # a batch; on a torch where it runs, the hook is returned.
    try:
        powerSGD_hook._orthogonalize(torch.ones(2, 1))
    except AssertionError:
        with pytest.raises(NotImplementedError, match=r"comm_hook='batched_powersgd'\) fails in "
                           r"this torch .*Use comm_hook='powersgd'"):  # fmt: skip
            comm_hook_state_and_fn(DDPOptions(comm_hook="batched_powersgd"), None)
    else:
        hook = comm_hook_state_and_fn(DDPOptions(comm_hook="batched_powersgd"), None)
        assert hook is not None and hook[1] is powerSGD_hook.batched_powerSGD_hook
