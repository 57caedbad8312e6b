"""The SGD loop the sp and ep tests run on a mesh, beside `tests.models.sgd_reference`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import accel
from tests.models import full_param


def train_on_mesh(
    ctx: accel.RunContext,
    model: nn.Module,
    loader: Any,
    loss_of: Callable[[nn.Module, Any], torch.Tensor],
    *,
    lr: float,
    max_norm: float,
    steps: tuple[int, int],
    state: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """Steps [first, last) of `loader` with SGD (momentum 0.9) and clipping through accel's
    calls; `state`: ("save" or "load", folder) at the ends. Every rank scores as many tokens,
    so the mean of the ranks' losses over the world is the global mean."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if state is not None and state[0] == "load":
        accel.load_state(ctx, state[1], model=model, optimizer=opt, loader=loader)
    world = dataclasses.replace(ctx, parallelism=None, mesh=None)
    inner = accel.unwrap_model(model)
    losses, norms, grads = [], [], None
    for _, batch in zip(range(*steps), loader, strict=False):
        loss = loss_of(model, batch)
        accel.scaled_backward(ctx, loss)
        if grads is None:
            grads = {n: full_param(q.grad) for n, q in inner.named_parameters()}
        norms.append(accel.clip_grad_norm_(ctx, model, max_norm).item())
        assert accel.optimizer_step(ctx, opt)
        opt.zero_grad()
        losses.append(accel.reduce(world, loss.detach(), op="mean").item())
    if state is not None and state[0] == "save":
        accel.save_state(ctx, state[1], model=model, optimizer=opt, loader=loader)
    params = {n: full_param(q) for n, q in inner.named_parameters()}
    return {"losses": losses, "norms": norms, "grads": grads, "params": params}
