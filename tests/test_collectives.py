"""Single-process behaviour of the collectives: identity on one rank, errors at the boundary."""

from __future__ import annotations

import pytest
import torch

from accel import (
    RunContext,
    broadcast,
    broadcast_object,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
)


def test_one_process_returns_its_input() -> None:
    ctx = RunContext()
    tree = {"a": torch.tensor([1.0, 2.0]), "b": [torch.tensor(3)]}
    assert gather(ctx, tree) is tree
    assert reduce(ctx, tree["a"], op="sum") is tree["a"]
    assert broadcast(ctx, tree) is tree
    assert pad_across_processes(ctx, tree["a"]) is tree["a"]
    assert gather_object(ctx, "x") == ["x"]
    assert broadcast_object(ctx, {"k": 1}) == {"k": 1}


def test_bad_arguments_name_the_argument() -> None:
    ctx = RunContext()
    with pytest.raises(ValueError, match=r"reduce: op='avg' is not supported; expected one of"):
        reduce(ctx, torch.ones(1), op="avg")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"reduce: op='mean' needs floating-point tensors"):
        reduce(ctx, torch.ones(1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"broadcast: src=1 is not a rank of this context"):
        broadcast(ctx, torch.ones(1), src=1)
    with pytest.raises(ValueError, match=r"broadcast_object: src=-1"):
        broadcast_object(ctx, 1, src=-1)


@pytest.mark.parametrize(
    "call",
    [
        lambda c: gather(c, torch.ones(1)),
        lambda c: reduce(c, torch.ones(1)),
        lambda c: broadcast(c, torch.ones(1)),
        lambda c: pad_across_processes(c, torch.ones(1)),
        lambda c: gather_object(c, 1),
        lambda c: broadcast_object(c, 1),
    ],
)
def test_multi_rank_context_without_group_raises_runtime_error(call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(
        RuntimeError, match=r"but no process group is initialised; collectives need one"
    ):
        call(RunContext(rank=0, world_size=2))


def test_non_tensor_leaves_are_refused_before_any_communication() -> None:
    ctx = RunContext(rank=0, world_size=2, process_group=object())
    with pytest.raises(TypeError, match=r"gather: leaf 0 of the input is a float"):
        gather(ctx, [1.5])
