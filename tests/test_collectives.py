"""Single-process behaviour of the collectives: identity on one rank, errors at the boundary."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


class _Ops(TorchDispatchMode):
    """Records every aten op that runs (a read of a tensor into Python is _local_scalar_dense;
    on a GPU each such read, nonzero, or copy to the CPU waits for the device)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_one_process_collectives_run_no_tensor_op_so_never_wait_for_a_device() -> None:
    """What tests/gpu counts with torch's sync debug mode (0 syncs for gather of CUDA tensors
    at one process), seen on the CPU: nothing at all runs, so nothing can wait."""
    from torch.utils.data import DataLoader

    from accel import gather_for_metrics, shard_loader

    ctx = RunContext.single()
    tree = {"logits": torch.randn(4, 3), "labels": torch.arange(4)}
    with _Ops() as seen:
        gather(ctx, tree)
        reduce(ctx, tree["logits"], op="mean")
        broadcast(ctx, tree)
        pad_across_processes(ctx, tree)
    assert seen.ops == []
    loader = shard_loader(ctx, DataLoader(torch.arange(10.0), batch_size=4))
    for batch in loader:
        preds = {"p": batch * 2}
        with _Ops() as seen:
            gather_for_metrics(ctx, preds, loader=loader)
        assert set(seen.ops) <= {"aten.slice"}  # the last batch's real rows: a view


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
