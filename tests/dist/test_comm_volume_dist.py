"""The bytes sequence (sp) and expert (ep) parallelism move per step, against their formulas,
measured with the collectives' own sizes: every all-to-all that reaches torch.distributed's
dispatcher is recorded with its input tensor and split sizes (2 gloo ranks, one step).

Ulysses, per attention layer and step, a rank hands its all-to-alls
    2 (forward, backward) x b x s/sp x d x (2 H + 2 H_kv) x bytes
(q, k, v in and the output back, H heads and H_kv key/value heads of head_dim d, after tensor
parallelism), of which (sp - 1)/sp leaves the rank. The expert dispatcher, per MoE layer and
step: E x 8 bytes of counts, then 2 x (n k + r) x dim x bytes of tokens (its n k routed
assignments out and back, the r rows other ranks sent it back and forth; n tokens on the rank,
top-k), so 4 x n x k x dim x bytes per rank on average over the group; the rows routed to
other ranks' experts leave the rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import accel
from accel import Parallelism
from accel._mesh import with_mesh
from accel.testing import device_canary, run_world
from tests.models import DIM, EP_PLAN, HEADS, LAYERS, MoELlama, batches, make_model

pytestmark = pytest.mark.dist

BATCH, SEQ = 4, 8  # tokens of 9: inputs of 8


class AllToAllRecorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records (input bytes, input split sizes, row bytes) of every all_to_all_single
    (benchmarks/sequence_parallel.py measures with it too)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.calls: list[tuple[int, list[int], int]] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        if func.namespace == "c10d" and "alltoall_base" in func.__name__:
            _, source, _, in_splits = args[:4]
            row = source[0].numel() * source.element_size() if source.shape[0] else 0
            self.calls.append((source.numel() * source.element_size(), list(in_splits), row))
        return func(*args, **(kwargs or {}))


def sent_to_others(rank: int, calls: list[tuple[int, list[int], int]]) -> int:
    """Bytes of the recorded inputs that left this rank (equal chunks when no splits)."""
    total = 0
    for size, splits, row in calls:
        if splits:
            total += sum(n for r, n in enumerate(splits) if r != rank) * row
        else:
            total += size // 2  # 2 ranks: the other half
    return total


def _both(ctx: accel.RunContext) -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    return {which: _step(ctx, which) for which in ("sp", "ep")}


def _step(ctx: accel.RunContext, which: str) -> dict[str, Any]:
    ctx = dataclasses.replace(ctx, parallelism=None, mesh=None)
    ctx = with_mesh(ctx, Parallelism(sp=2) if which == "sp" else Parallelism(ep=2), source="test")
    tokens = batches(1, BATCH)[0]
    if which == "sp":
        model = accel.wrap_model(ctx, make_model(), sp_plan=("layers.*.attention",))
        inputs = tokens[:, :-1].chunk(2, 1)[ctx.sp_rank].contiguous().to(ctx.device)
        targets = tokens[:, 1:].chunk(2, 1)[ctx.sp_rank].to(ctx.device)
    else:
        torch.manual_seed(0)
        model = accel.wrap_model(ctx, MoELlama(), ep_plan=EP_PLAN)
        mine = tokens.chunk(2)[ctx.dp_rank].to(ctx.device)
        inputs, targets = mine[:, :-1], mine[:, 1:]
    with AllToAllRecorder() as calls:
        logits = model(inputs)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    return {"calls": calls.calls, "sent": sent_to_others(ctx.rank, calls.calls)}


def test_bytes_moved_by_sp_and_ep_follow_their_formulas() -> None:
    with device_canary():
        results = run_world(_both, world_size=2, timeout=120)
    sp, ep = [r["sp"] for r in results], [r["ep"] for r in results]
    # Ulysses: b x s/sp x head_dim x (2 H + 2 H_kv) x 4 bytes, forward and backward, per layer
    head_dim, s_local = DIM // HEADS, SEQ // 2
    per_layer = 2 * BATCH * s_local * head_dim * (2 * HEADS + 2 * HEADS) * 4
    for out in sp:
        assert len(out["calls"]) == LAYERS * 8  # q, k, v, out; and their gradients
        assert sum(size for size, _, _ in out["calls"]) == LAYERS * per_layer
        assert out["sent"] == LAYERS * per_layer // 2  # (sp - 1) / sp of it leaves the rank
    # experts: per rank 8 E bytes of counts, then 2 (n k + r) x dim x 4 bytes of tokens: its n k
    # assignments out and their outputs' gradients back in, the r rows it received back out and
    # their gradients in; over the ep group the r sum to the n k, so per rank on average
    # 8 E + 4 n k dim x 4 bytes
    n, k, experts, row = BATCH // 2 * SEQ, 2, 4, DIM * 4
    per_moe = experts * 8 + 4 * n * k * row
    for out in ep:
        assert len(out["calls"]) == LAYERS * 5  # counts, tokens there and back, x2 backward
        dispatched = [size for size, splits, _ in out["calls"] if sum(splits) == n * k]
        assert len(dispatched) >= 2 * LAYERS  # the n k assignments leave, their grads return
        assert 0 < out["sent"] < LAYERS * per_moe  # the rows routed to the other rank's experts
    total = sum(size for out in ep for size, _, _ in out["calls"])
    assert total == 2 * LAYERS * per_moe  # the group's all-to-alls move the formula's bytes
    print(f"sp=2: {LAYERS * per_layer} B handed to all-to-alls per rank and step "
          f"({sp[0]['sent']} B left rank 0); ep=2: {total} B over both ranks, "
          f"{LAYERS * per_moe} B per rank on average ({ep[0]['sent']} B left rank 0)")  # fmt: skip
