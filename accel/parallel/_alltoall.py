"""An autograd-aware `all_to_all_single`: what Ulysses and the expert dispatcher exchange.

Forward sends chunk j of dim 0 to rank j (chunk sizes `in_splits`, equal when None) and
receives `out_splits`; the gradient goes back by the same exchange with the splits swapped,
its exact inverse (chunk j of rank i went to chunk i of rank j).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None,
        group: Any,
    ) -> torch.Tensor:  # fmt: skip
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def _exchange(
    x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group: Any
) -> torch.Tensor:
    x = x.contiguous()
    rows = x.shape[0] if out_splits is None else sum(out_splits)
    out = x.new_empty((rows, *x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


def all_to_all(
    x: torch.Tensor,
    group: Any,
    *,
    out_splits: list[int] | None = None,
    in_splits: list[int] | None = None,
) -> torch.Tensor:
    """Exchange the chunks of dim 0 of `x` over `group`, differentiably (see the module doc)."""
    out: torch.Tensor = _AllToAll.apply(x, out_splits, in_splits, group)  # type: ignore[no-untyped-call]
    return out
