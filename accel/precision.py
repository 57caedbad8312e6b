"""Mixed precision and the optimizer step: autocast, loss scaling, skipped steps, clipping.

Choose once from `ctx.precision`, then use a value: `autocast(ctx)` is a no-op context in fp32,
`make_scaler(ctx)` is None unless fp16. `scaled_backward` is the one place the loss is divided by
`ctx.grad_accum_steps`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from accel._dtensor import is_dtensor
from accel._groups import comm_device, named_collective, require_group
from accel._typing import COMPUTE_DTYPES
from accel.context import RunContext, along
from accel.parallel import check_optimizer
from accel.parallel.deepspeed import deepspeed_engine

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

    >>> import torch
    >>> from torch import nn
    >>> from accel import autocast, RunContext
    >>> with autocast(RunContext.single(precision="bf16")):
    ...     y = nn.Linear(2, 2)(torch.ones(1, 2))
    >>> y.dtype
    torch.bfloat16
    """
    dtype = COMPUTE_DTYPES.get(ctx.precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(ctx.device.type, dtype=dtype)


def make_scaler(ctx: RunContext) -> GradScaler | None:
    """Make a `torch.amp.GradScaler` for fp16 (CUDA or CPU); None for fp32 and bf16.

    Works under DDP, FSDP2 and tensor parallelism: `optimizer_step` and `clip_grad_norm_`
    make the ranks agree on whether any gradient shard holds inf or nan, so all skip together.

    The scaler is training state: you hold it, and `save_state` checkpoints it.

    Args:
        ctx: the run context; `ctx.precision` decides, `ctx.device.type` is the scaler's
            device.

    Returns:
        A new `GradScaler` with torch's defaults when `ctx.precision == "fp16"`, else None.
        Pass it to `scaled_backward`, `optimizer_step` and the clipping functions.

    Example:

    >>> from accel import make_scaler, RunContext
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

    >>> import torch
    >>> from accel import RunContext, scaled_backward
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
    ctx: RunContext, fn: str, optimizer: torch.optim.Optimizer | None, scaler: GradScaler | None
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
    _unscale_once(ctx, scaler, optimizer)


def _unscale_once(ctx: RunContext, scaler: GradScaler, optimizer: torch.optim.Optimizer) -> None:
    if scaler.is_enabled() and _has_dtensor(optimizer):
        _unscale_sharded(ctx, scaler, optimizer)
        return
    try:
        scaler.unscale_(optimizer)
    except RuntimeError as err:
        # GradScaler refuses a second unscale_ before update(); the gradients are unscaled.
        if "unscale_() has already been called" not in str(err):
            raise


def _unscale_sharded(ctx: RunContext, scaler: GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """GradScaler.unscale_ for sharded (DTensor) gradients, with found-inf agreed by all ranks.

    GradScaler checks each rank's own shard only, so ranks could disagree (one skips the step,
    another takes it) and it cannot take plain and DTensor gradients in one call (tensor
    parallelism leaves norms and embeddings plain). So the local shards are unscaled here,
    the inf/nan flag is all-reduced over the world, and the result is recorded where
    step()/update() read it: GradScaler's per-optimizer state (private, unchanged since
    torch 1.6; ShardedGradScaler writes the same fields).
    """
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.UNSCALED:
        return
    if state["stage"] is OptState.STEPPED:
        raise RuntimeError("optimizer_step: unscale_() is being called after step().")
    assert scaler._scale is not None  # set by the first scale() call
    inv_scale = scaler._scale.double().reciprocal().float()
    found = torch.zeros(1, device=scaler._scale.device)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                local = p.grad.to_local() if is_dtensor(p.grad) else p.grad
                by_kind.setdefault((local.device, local.dtype), []).append(local)
    for (device, _), grads in by_kind.items():
        found_here = found.to(device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_here, inv_scale.to(device))
        found = torch.maximum(found, found_here.to(found.device))
    flag = found.to(comm_device(ctx))
    if ctx.world_size > 1:
        with named_collective(ctx, "optimizer_step"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=require_group(ctx, "optimizer_step"))
    state["found_inf_per_device"] = {found.device: flag.to(found.device)}
    state["stage"] = OptState.UNSCALED


def _has_dtensor(optimizer: torch.optim.Optimizer) -> bool:
    return any(
        is_dtensor(p) and p.grad is not None
        for group in optimizer.param_groups
        for p in group["params"]
    )


def optimizer_step(
    ctx: RunContext, optimizer: torch.optim.Optimizer, *, scaler: GradScaler | None = None
) -> bool:
    """Step `optimizer` (through `scaler` in fp16) and return whether it stepped.

    With a scaler, a step whose gradients hold inf or nan is skipped: parameters and optimizer
    state stay as they were, the scale is lowered, and this returns False. Call `zero_grad()`
    and `scheduler.step()` yourself as usual. For the optimizer of a DeepSpeed engine
    (`DeepSpeedOptions.optimizer`, or the engine's) this is the engine's `step()`: it clips by
    its config, steps and zeroes the gradients.

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

    >>> import torch
    >>> from accel import optimizer_step, RunContext
    >>> w = torch.nn.Parameter(torch.ones(1))
    >>> opt = torch.optim.SGD([w], lr=0.5)
    >>> (2 * w).sum().backward()
    >>> optimizer_step(RunContext.single(), opt), w.item()
    (True, 0.0)
    """
    engine = deepspeed_engine(optimizer)
    if engine is not None:
        return _engine_step(engine, scaler)
    check_optimizer(optimizer)
    _warn_if_schedule_ended(optimizer)
    if scaler is None:
        optimizer.step()
        return True
    before = scaler.get_scale()
    _unscale_once(ctx, scaler, optimizer)
    scaler.step(optimizer)
    scaler.update()
    # update() multiplies the scale by backoff_factor (< 1) exactly when inf/nan was found.
    return not scaler.get_scale() < before


def _warn_if_schedule_ended(optimizer: torch.optim.Optimizer) -> None:
    """Warn (at optimizer_step's caller) when every rate is 0 under a scheduler (torch sets
    `initial_lr`) and the optimizer stepped before (its state, or the flag torch's scheduler
    sets; a warmup from 0 is at its first step). accel steps no scheduler: this step is where a
    short one shows (Accelerate's schedule sized from len(loader) after shard_loader)."""
    for group in optimizer.param_groups:  # a tensor rate is not read: that would wait for it
        if "initial_lr" not in group or isinstance(group["lr"], torch.Tensor) or group["lr"]:
            return
    if optimizer.param_groups and (optimizer.state or getattr(optimizer, "_opt_called", False)):
        warnings.warn(
            "optimizer_step: every learning rate is 0 and the optimizer has stepped before: its "
            "scheduler has ended and this step changes no weight. A schedule sized from "
            "len(loader) after shard_loader counts this rank's batches (1/world_size of them): "
            "size Accelerate's schedule from the DataLoader before shard_loader and step it "
            "ctx.world_size times per step, or size it in optimizer steps and step it once.",
            stacklevel=3,
        )


def _engine_step(engine: Any, scaler: GradScaler | None) -> bool:
    """DeepSpeed: the engine's step (clip by its config, step, zero the gradients)."""
    if scaler is not None:
        raise ValueError(
            "optimizer_step: scaler= was given for a DeepSpeed engine, which scales the loss "
            "itself; drop scaler= (make_scaler returns None outside fp16)."
        )
    skipped = engine.skipped_steps
    engine.step()
    return bool(engine.skipped_steps == skipped)


def _engine_clip(engine: Any, max_norm: float, norm_type: float) -> torch.Tensor:
    """DeepSpeed clips inside its step, by its config; check that it is this clipping."""
    configured = float(engine.gradient_clipping() or 0.0)
    if norm_type != 2.0 or configured != float(max_norm):
        raise ValueError(
            f"clip_grad_norm_: max_norm={max_norm!r}, norm_type={norm_type!r} on a DeepSpeed "
            f"engine whose config clips to gradient_clipping={configured!r} (2-norm) inside "
            "its step; set gradient_clipping to max_norm in the DeepSpeed config (or drop the "
            "call and keep the config's)."
        )
    return torch.full((), float("nan"))


def _with_grads(model: nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
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
    averaged; under FSDP2, tensor parallelism and their mixes (parameters on several meshes)
    the norm is computed over all shards, so every rank gets the global norm. Call it on sync
    steps only (inside `accumulate`, when `sync` is True). A DeepSpeed engine clips inside
    `optimizer_step` by its config's `gradient_clipping`, which must equal `max_norm`; the
    norm is not known before that step, so NaN is returned (read it afterwards from
    `deepspeed_engine(model).get_global_grad_norm()`).

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

    >>> import torch
    >>> from accel import clip_grad_norm_, RunContext
    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> w.grad = torch.tensor([3.0, 4.0])
    >>> clip_grad_norm_(RunContext.single(), [w], 1.0).item(), w.grad.norm().item() < 1.0
    (5.0, True)
    """
    engine = deepspeed_engine(model)
    if engine is not None:
        return _engine_clip(engine, max_norm, norm_type)
    _unscale_before_clip(ctx, "clip_grad_norm_", optimizer, scaler)
    params = _with_grads(model)
    if ctx.pp_size > 1:  # every stage's norm is a part of the whole model's
        return _clip_over_stages(ctx, params, max_norm, norm_type)
    if not params:
        return torch.zeros((), device=ctx.device)
    groups = _by_mesh(params)
    if len(groups) == 1:  # one mesh (or plain tensors): torch's own call does it all
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        return _full(norm)
    # Parameters on different meshes (tensor-parallel layers on (dp_shard, tp), the rest on
    # dp_shard): DTensor cannot stack their norms, so each mesh's norm is made whole and the
    # parts combined, as torchtitan does for its mixed meshes.
    parts = [_full(torch.nn.utils.get_total_norm(_grads(g), norm_type)) for g in groups]
    stacked = torch.stack([q.to(parts[0].device) for q in parts])
    total = stacked.max() if norm_type == float("inf") else stacked.norm(norm_type)
    for g in groups:
        torch.nn.utils.clip_grads_with_norm_(g, max_norm, total.to(g[0].device))
    return total


def _clip_over_stages(
    ctx: RunContext, params: list[torch.Tensor], max_norm: float, norm_type: float
) -> torch.Tensor:
    """Clip pipeline stages to the whole model's norm: each rank's stage norms combined over
    the pp group (sum of p-th powers, or max), as torchtitan's pipelined clipping does."""
    groups = _by_mesh(params)
    parts = [_full(torch.nn.utils.get_total_norm(_grads(g), norm_type)) for g in groups]
    device = comm_device(ctx)
    local = torch.zeros((), device=device, dtype=torch.float32)
    inf = norm_type == float("inf")
    for q in parts:
        q = q.to(device, torch.float32)
        local = torch.maximum(local, q) if inf else local + q**norm_type
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    dist.all_reduce(local, op=op, group=along(ctx, "pp").process_group)
    total = local if inf else local ** (1.0 / norm_type)
    for g in groups:
        torch.nn.utils.clip_grads_with_norm_(g, max_norm, total.to(g[0].device))
    return total


def _full(norm: torch.Tensor) -> torch.Tensor:
    # A DTensor norm holds partial sums per shard; full_tensor() makes it the global one.
    return norm.full_tensor() if is_dtensor(norm) else norm


def _grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [q.grad for q in params if q.grad is not None]


def _by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[Any, list[torch.Tensor]] = {}
    for q in params:
        groups.setdefault(getattr(q, "device_mesh", None), []).append(q)
    return list(groups.values())


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

    >>> import torch
    >>> from accel import clip_grad_value_, RunContext
    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> w.grad = torch.tensor([3.0, -0.5])
    >>> clip_grad_value_(RunContext.single(), [w], 1.0)
    >>> w.grad
    tensor([ 1.0000, -0.5000])
    """
    if deepspeed_engine(model) is not None:
        raise NotImplementedError(
            "clip_grad_value_: a DeepSpeed engine clips only by the global norm of its config "
            "(gradient_clipping); use clip_grad_norm_(ctx, model, max_norm) with that value."
        )
    _unscale_before_clip(ctx, "clip_grad_value_", optimizer, scaler)
    params = model.parameters() if isinstance(model, nn.Module) else model
    torch.nn.utils.clip_grad_value_(list(params), clip_value)
