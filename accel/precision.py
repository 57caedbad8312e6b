"""Mixed precision and the optimizer step: autocast, loss scaling, skipped steps, clipping.

Choose once from `ctx.precision`, then use a value: `autocast(ctx)` is a no-op context in fp32,
`make_scaler(ctx)` is None unless fp16. `scaled_backward` is the one place the loss is divided by
`ctx.grad_accum_steps`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from accel.context import RunContext
from accel.parallel import check_optimizer
from accel.parallel._dtensor import is_dtensor

if TYPE_CHECKING:
    from torch.amp import GradScaler

__all__ = [
    "autocast",
    "clip_grad_norm_",
    "clip_grad_value_",
    "make_scaler",
    "optimizer_step",
    "scaled_backward",
]

_DTYPES = MappingProxyType({"bf16": torch.bfloat16, "fp16": torch.float16})


def autocast(ctx: RunContext) -> contextlib.AbstractContextManager[Any]:
    """Autocast to `ctx.precision` on `ctx.device`; a no-op context in fp32.

    Put the forward pass and the loss inside; call `scaled_backward` outside it.

    Args:
        ctx: the run context; `ctx.precision` ("bf16" or "fp16" autocast, "fp32" none) and
            `ctx.device.type` pick the autocast.

    Returns:
        A context manager: `torch.autocast(device_type, dtype)` for bf16 and fp16, a
        `contextlib.nullcontext()` for fp32.

    Example:

    >>> from accel import RunContext
    >>> with autocast(RunContext.single(precision="bf16")):
    ...     y = nn.Linear(2, 2)(torch.ones(1, 2))
    >>> y.dtype
    torch.bfloat16
    """
    dtype = _DTYPES.get(ctx.precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(ctx.device.type, dtype=dtype)


def make_scaler(ctx: RunContext) -> GradScaler | None:
    """Make a `torch.amp.GradScaler` for fp16 (CUDA or CPU); None for fp32 and bf16.

    The scaler is training state: you hold it, and `save_state` checkpoints it.

    Args:
        ctx: the run context; `ctx.precision` decides, `ctx.device.type` is the scaler's
            device.

    Returns:
        A new `GradScaler` with torch's defaults when `ctx.precision == "fp16"`, else None.
        Pass it to `scaled_backward`, `optimizer_step` and the clipping functions.

    Example:

    >>> from accel import RunContext
    >>> make_scaler(RunContext.single()) is None
    True
    >>> type(make_scaler(RunContext.single(precision="fp16"))).__name__
    'GradScaler'
    """
    if ctx.precision != "fp16":
        return None
    from torch.amp import GradScaler

    return GradScaler(ctx.device.type)


def scaled_backward(
    ctx: RunContext, loss: torch.Tensor, *, scaler: GradScaler | None = None
) -> None:
    """Run `loss.backward()` on the loss divided by `ctx.grad_accum_steps` (and fp16-scaled).

    Dividing by the accumulation steps makes the gradients summed over a window the mean over
    its micro-batches. `loss` itself is not modified.

    Args:
        ctx: the run context; `ctx.grad_accum_steps` is the divisor.
        loss: a scalar loss tensor that requires grad.
        scaler: the scaler from `make_scaler` in fp16, which multiplies the loss by its scale;
            default None, no scaling.

    Example:

    >>> from accel import RunContext
    >>> w = torch.ones(2, requires_grad=True)
    >>> scaled_backward(RunContext.single(grad_accum_steps=2), (w * 3).sum())
    >>> w.grad
    tensor([1.5000, 1.5000])
    """
    if ctx.grad_accum_steps != 1:
        loss = loss / ctx.grad_accum_steps
    if scaler is not None:
        loss = scaler.scale(loss)
    loss.backward()  # type: ignore[no-untyped-call]


def _unscale_before_clip(
    fn: str, optimizer: torch.optim.Optimizer | None, scaler: GradScaler | None
) -> None:
    """Unscale the gradients once per step before clipping them (fp16; nothing without a scaler)."""
    if scaler is None:
        return
    if optimizer is None:
        raise ValueError(
            f"{fn}: a scaler was given without optimizer=; pass the optimizer so its gradients "
            "are unscaled before clipping."
        )
    check_optimizer(optimizer)
    _unscale_once(scaler, optimizer)


def _unscale_once(scaler: GradScaler, optimizer: torch.optim.Optimizer) -> None:
    try:
        scaler.unscale_(optimizer)
    except RuntimeError as err:
        # GradScaler refuses a second unscale_ before update(); the gradients are unscaled.
        if "unscale_() has already been called" not in str(err):
            raise


def optimizer_step(
    ctx: RunContext, optimizer: torch.optim.Optimizer, *, scaler: GradScaler | None = None
) -> bool:
    """Step `optimizer` (through `scaler` in fp16) and return whether it stepped.

    With a scaler, a step whose gradients hold inf or nan is skipped: parameters and optimizer
    state stay as they were, the scale is lowered, and this returns False. Call `zero_grad()`
    and `scheduler.step()` yourself as usual.

    Args:
        ctx: the run context.
        optimizer: the optimizer to step, created from the wrapped model's parameters.
        scaler: the scaler from `make_scaler` in fp16; default None, a plain
            `optimizer.step()`.

    Returns:
        True when the optimizer stepped; False when the scaler skipped the step for inf or nan
        gradients.

    Raises:
        ValueError: when the optimizer holds parameters FSDP2 wrapping replaced (see
            `check_optimizer`).

    Example:

    >>> from accel import RunContext
    >>> w = torch.nn.Parameter(torch.ones(1))
    >>> opt = torch.optim.SGD([w], lr=0.5)
    >>> (2 * w).sum().backward()
    >>> optimizer_step(RunContext.single(), opt), w.item()
    (True, 0.0)
    """
    check_optimizer(optimizer)
    if scaler is None:
        optimizer.step()
        return True
    before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    # update() multiplies the scale by backoff_factor (< 1) exactly when inf/nan was found.
    return not scaler.get_scale() < before


def _grads_of(model: nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    params = model.parameters() if isinstance(model, nn.Module) else model
    return [p for p in params if p.grad is not None]


def clip_grad_norm_(
    ctx: RunContext,
    model: nn.Module | Iterable[torch.Tensor],
    max_norm: float,
    *,
    norm_type: float = 2.0,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: GradScaler | None = None,
) -> torch.Tensor:
    """Clip the gradients of `model` to a global norm of `max_norm`; return the norm before.

    In fp16 pass `optimizer` and `scaler`: gradients are unscaled first, once per step (the
    following `optimizer_step` does not unscale again). Under DDP gradients are already
    averaged; under FSDP2 the norm is computed over all shards, so every rank gets the global
    norm. Call it on sync steps only (inside `accumulate`, when `sync` is True).

    Args:
        ctx: the run context; with no gradients at all, the zero norm is put on `ctx.device`.
        model: a model, or an iterable of parameters; those without a gradient are skipped.
        max_norm: the largest total norm the gradients keep.
        norm_type: the p of the p-norm; default 2.0 (`float("inf")` for the max norm).
        optimizer: the optimizer whose gradients are unscaled first; needed with `scaler`.
        scaler: the fp16 scaler; default None, gradients are not unscaled.

    Returns:
        The total norm of the gradients before clipping, a 0-dim tensor (the global norm
        under FSDP2; 0 when no parameter has a gradient).

    Raises:
        ValueError: for a `scaler` without `optimizer`, or an optimizer holding parameters
            FSDP2 wrapping replaced.

    Example:

    >>> from accel import RunContext
    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> w.grad = torch.tensor([3.0, 4.0])
    >>> clip_grad_norm_(RunContext.single(), [w], 1.0).item(), w.grad.norm().item() < 1.0
    (5.0, True)
    """
    _unscale_before_clip("clip_grad_norm_", optimizer, scaler)
    grads = _grads_of(model)
    if not grads:
        return torch.zeros((), device=ctx.device)
    norm = torch.nn.utils.clip_grad_norm_(grads, max_norm, norm_type=norm_type)
    return norm.full_tensor() if is_dtensor(norm) else norm  # a DTensor norm under FSDP2


def clip_grad_value_(
    ctx: RunContext,
    model: nn.Module | Iterable[torch.Tensor],
    clip_value: float,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: GradScaler | None = None,
) -> None:
    """Clamp every gradient of `model` to [-clip_value, clip_value] (unscaled first in fp16).

    Each element is clamped on its own rank; under FSDP2 that is each shard.

    Args:
        ctx: the run context; not read, taken so every step function has the same shape.
        model: a model, or an iterable of parameters; those without a gradient are skipped.
        clip_value: the largest absolute value a gradient element keeps.
        optimizer: the optimizer whose gradients are unscaled first; needed with `scaler`.
        scaler: the fp16 scaler; default None, gradients are not unscaled.

    Raises:
        ValueError: for a `scaler` without `optimizer`, or an optimizer holding parameters
            FSDP2 wrapping replaced.

    Example:

    >>> from accel import RunContext
    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> w.grad = torch.tensor([3.0, -0.5])
    >>> clip_grad_value_(RunContext.single(), [w], 1.0)
    >>> w.grad
    tensor([ 1.0000, -0.5000])
    """
    _unscale_before_clip("clip_grad_value_", optimizer, scaler)
    params = model.parameters() if isinstance(model, nn.Module) else model
    torch.nn.utils.clip_grad_value_(list(params), clip_value)
