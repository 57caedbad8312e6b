"""Wrap a model for the run: device placement, then DDP or FSDP2, then optional torch.compile.

`wrap_model(ctx, model, strategy=...)` picks one strategy and returns the model to train;
`unwrap_model(model)` gives back the module the user built, for saving or inspection.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accel.context import RunContext
from accel.parallel._ddp import DDPOptions, apply_ddp
from accel.parallel._fsdp import REPLACED, FSDPOptions, apply_fsdp2

__all__ = ["DDPOptions", "FSDPOptions", "check_optimizer", "unwrap_model", "wrap_model"]

Strategy = Literal["auto", "none", "ddp", "fsdp2"]


def _is_wrapped(model: nn.Module) -> str | None:
    from torch.distributed.fsdp import FSDPModule  # on use: importing FSDP costs start-up time

    if isinstance(model, DistributedDataParallel):
        return "DistributedDataParallel"
    if isinstance(model, FSDPModule):
        return "FSDP2 (fully_shard)"
    if hasattr(model, "_orig_mod"):
        return "torch.compile"
    return None


def wrap_model(
    ctx: RunContext,
    model: nn.Module,
    *,
    strategy: Strategy = "auto",
    compile: bool = False,
    ddp: DDPOptions | None = None,
    fsdp: FSDPOptions | None = None,
) -> nn.Module:
    """Move `model` to `ctx.device` and wrap it for data-parallel training; use the return value.

    strategy: "none" (device placement only), "ddp" (DistributedDataParallel over
    `ctx.process_group`), "fsdp2" (`torch.distributed.fsdp.fully_shard` per `fsdp.layer_classes`
    module, then the root, with a bf16 mixed-precision policy when `ctx.precision == "bf16"`), or
    "auto" (ddp when `ctx.world_size > 1`, else none). `compile=True` applies `torch.compile`
    last. Create the optimizer from the returned model's parameters: FSDP2 replaces them.

    `unwrap_model` returns the module you passed. DDP and compile keep it untouched inside;
    FSDP2 shards it in place (its class and parameters change), which is how FSDP2 works.

    Args:
        ctx: the run context; `ctx.device`, `ctx.process_group` and `ctx.precision` are used.
        model: the module to train, not wrapped yet.
        strategy: "auto", "none", "ddp" or "fsdp2", as above; default "auto".
        compile: apply `torch.compile` to the wrapped model; default False.
        ddp: options for DistributedDataParallel (strategy "ddp" or "auto"); default None,
            DDP's defaults.
        fsdp: options for FSDP2 (strategy "fsdp2"), such as `layer_classes`; default None,
            only the root is sharded.

    Returns:
        The model to train: the module itself (strategy "none", or "fsdp2", sharded in place),
        or a DDP wrapper, and with `compile`, `torch.compile`'s module around that.

    Raises:
        ValueError: for an unknown `strategy`, a model that is already wrapped, options for
            another strategy, or "fsdp2" without a process group.
        TypeError: for a `model` that is not an `nn.Module`.
        NotImplementedError: for "fsdp2" with precision "fp16".
        RuntimeError: for "ddp" when no process group is initialised.

    Example:

    >>> from accel import RunContext
    >>> m = wrap_model(RunContext.single(), nn.Linear(2, 2))
    >>> unwrap_model(m).weight.device.type
    'cpu'
    """
    if strategy not in get_args(Strategy):
        raise ValueError(
            f"wrap_model: strategy={strategy!r} is not one of {get_args(Strategy)}; "
            "use 'auto' to pick DDP when there are several processes."
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap_model: model={type(model).__name__} is not a torch.nn.Module.")
    wrapped_by = _is_wrapped(model)
    if wrapped_by is not None:
        raise ValueError(
            f"wrap_model: the model is already wrapped by {wrapped_by}; wrap the original module "
            "once (accel.unwrap_model(model) returns it)."
        )
    if ddp is not None and strategy not in ("ddp", "auto"):
        raise ValueError(f"wrap_model: ddp options were given but strategy={strategy!r}.")
    if fsdp is not None and strategy != "fsdp2":
        raise ValueError(f"wrap_model: fsdp options were given but strategy={strategy!r}.")
    if strategy == "auto":
        strategy = "ddp" if ctx.world_size > 1 else "none"

    if strategy == "fsdp2":
        wrapped = apply_fsdp2(ctx, model, fsdp or FSDPOptions())
    else:
        model.to(ctx.device)
        wrapped = apply_ddp(ctx, model, ddp or DDPOptions()) if strategy == "ddp" else model
    if compile:
        wrapped = torch.compile(wrapped)  # type: ignore[assignment]
    return wrapped


def unwrap_model(model: nn.Module) -> nn.Module:
    """Return the module the user built, from inside DDP and `torch.compile` wrappers.

    Wrappers nested in any order are all removed. An FSDP2 model is its own module (sharded in
    place), so it comes back as it is.

    Args:
        model: a model, wrapped by `wrap_model` or not.

    Returns:
        The innermost module; `model` itself when it is not wrapped.

    Example:

    >>> from accel import RunContext
    >>> inner = nn.Linear(2, 2)
    >>> unwrap_model(wrap_model(RunContext.single(), inner)) is inner
    True
    """
    while True:
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if inner is None and isinstance(model, DistributedDataParallel):
            inner = model.module
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise if `optimizer` holds parameters that FSDP2 wrapping replaced.

    `optimizer_step` and `clip_grad_norm_` call this; call it yourself when you step by hand.

    Args:
        optimizer: the optimizer about to be stepped.

    Raises:
        ValueError: when it was created before `wrap_model(..., strategy="fsdp2")` and holds
            the parameters that wrapping replaced.

    Example:

    >>> check_optimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, REPLACED, False):
                raise ValueError(
                    "The optimizer was created before wrap_model(..., strategy='fsdp2') and "
                    "holds the parameters FSDP2 replaced, so it would train nothing. Create it "
                    "after wrapping: model = accel.wrap_model(ctx, model, strategy='fsdp2'); "
                    "optimizer = torch.optim.AdamW(model.parameters(), ...)."
                )
