"""Wrap a model for the run: tensor parallel, activation checkpointing, compile, FSDP2 or DDP.

`wrap_model(ctx, model)` follows `ctx.parallelism` (or the strategy you name) and returns the
model to train; `unwrap_model(model)` gives back the module the user built.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accel._groups import require_group
from accel._parallelism import CompileMode, FSDPOptions, Parallelism
from accel.context import RunContext
from accel.parallel import _fsdp, _tp
from accel.parallel._ddp import DDPOptions, apply_ddp
from accel.parallel._fsdp import REPLACED

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


@dataclass(frozen=True, slots=True)
class _Choice:
    """What wrap_model applies: tensor parallel or not, then one data-parallel wrapper."""

    tp: bool
    data: Literal["none", "ddp", "fsdp2"]


def _choose(
    ctx: RunContext, strategy: Strategy, *, tp_plan: Any, fsdp: bool, ddp: DDPOptions | None
) -> _Choice:
    """Decide from the context and the arguments; raise for combinations that cannot hold."""
    p = ctx.parallelism or Parallelism(dp_replicate=ctx.world_size)
    sharded = p.dp_shard > 1 or p.cp > 1
    data: Literal["none", "ddp", "fsdp2"]
    if strategy == "auto":
        data = "fsdp2" if sharded else ("ddp" if p.dp_replicate > 1 else "none")
    else:
        data = strategy
    explicit = ctx.parallelism is not None
    if explicit and data == "fsdp2" and not sharded:
        raise ValueError(
            f"wrap_model: strategy='fsdp2' but ctx.parallelism={p} shards over nothing "
            "(dp_shard=1). Give the context Parallelism(dp_shard=...), or use strategy='auto'."
        )
    if explicit and data == "ddp" and sharded:
        raise ValueError(
            f"wrap_model: strategy='ddp' but ctx.parallelism={p} has dp_shard={p.dp_shard}; "
            "DDP would keep full replicas on ranks meant to share. Use strategy='auto'."
        )
    tp = p.tp > 1 and strategy != "none"  # "none" is device placement only
    if tp and tp_plan is None:
        raise ValueError(
            f"wrap_model: ctx.parallelism has tp={p.tp} but tp_plan=None; pass the layers to "
            "split, e.g. tp_plan={'layers.*.attention.wq': 'colwise', ...}, or tp_plan='auto' "
            "for a Hugging Face model."
        )
    if tp_plan is not None and not tp:
        raise ValueError(
            f"wrap_model: tp_plan was given but nothing is split (strategy={strategy!r}, "
            f"tp={p.tp}); build the context with Parallelism(tp=...), or drop tp_plan."
        )
    if fsdp and data != "fsdp2":
        raise ValueError(
            f"wrap_model: fsdp options were given but strategy={strategy!r} shards nothing with "
            f"{p} (dp_shard=1); use Parallelism(dp_shard=...) with strategy='auto', or drop fsdp=."
        )
    if ddp is not None and data != "ddp":
        what = "ddp options were given"
        if ddp.comm_hook is not None:
            what = f"ddp=DDPOptions(comm_hook={ddp.comm_hook!r}) is a DDP communication hook"
        raise ValueError(
            f"wrap_model: {what} but strategy={strategy!r} applies {data!r}, "
            "not DDP; drop ddp= or use strategy='ddp'."
        )
    if tp and data == "ddp":
        raise NotImplementedError(
            f"wrap_model: DDP over dp_replicate={p.dp_replicate} with tp={p.tp} is not "
            "supported (DDP cannot reduce tensor-parallel DTensor gradients). Shard instead: "
            f"Parallelism(dp_shard={p.dp_replicate}, tp={p.tp}) applies FSDP2 with TP."
        )
    return _Choice(tp=tp, data=data)


def wrap_model(
    ctx: RunContext,
    model: nn.Module,
    *,
    strategy: Strategy = "auto",
    tp_plan: Mapping[str, Any] | Literal["auto"] | None = None,
    fsdp: FSDPOptions | None = None,
    ddp: DDPOptions | None = None,
    compile: CompileMode | None = None,
) -> nn.Module:
    """Move `model` to `ctx.device` and parallelize it for training; use the return value.

    `strategy="auto"` follows `ctx.parallelism`: tensor parallel when tp > 1 (by `tp_plan`),
    FSDP2 over dp_shard when dp_shard > 1 (HSDP over (dp_replicate, dp_shard) when both are
    > 1), else DDP over dp_replicate when > 1, else device placement only. Without a
    `Parallelism` every rank is a replica (DDP). "none", "ddp" and "fsdp2" force one wrapper.
    Applied in the order: tensor parallel, activation checkpointing, regional compile, FSDP2
    (or DDP), whole-model compile. Create the optimizer from the returned model's parameters:
    tensor parallel and FSDP2 replace them (in place: `unwrap_model` returns your module).

    Args:
        ctx: the run's context; its mesh supplies the groups.
        model: the module to train.
        strategy: "auto", "none", "ddp" or "fsdp2".
        tp_plan: module-name patterns ('*' is one name segment) to "colwise", "rowwise" or a
            torch ParallelStyle; or "auto" for a Hugging Face model's `base_model_tp_plan`.
        fsdp: FSDP2 options (layer classes, reshard, mixed precision, activation
            checkpointing); default `ctx.fsdp`, the launcher config's.
        ddp: DistributedDataParallel options and its communication hook (`comm_hook`).
        compile: False, True (whole model, last) or "regional" (each repeated block, before
            sharding); default `ctx.compile`.

    Returns:
        The model to train: the module itself (strategy "none", tensor parallel or FSDP2, all
        applied in place), or a DDP wrapper, and with `compile=True`, `torch.compile`'s
        module around that.

    Raises:
        ValueError: for an unknown `strategy`, a model that is already wrapped, options for
            another strategy, a strategy or plan that contradicts `ctx.parallelism`, a tp plan
            naming no module or a tp size not dividing a split dimension, a layer class
            matching nothing, or "fsdp2" without a process group.
        TypeError: for a `model` that is not an `nn.Module`.
        NotImplementedError: for DDP combined with tensor parallelism, or offload_params on a
            CPU run.
        RuntimeError: for "ddp" when no process group is initialised, or a split world
            without a DeviceMesh.

    Example:

    >>> from torch import nn
    >>> from accel import RunContext, unwrap_model, wrap_model
    >>> m = wrap_model(RunContext.single(), nn.Linear(2, 2))
    >>> unwrap_model(m).weight.device.type
    'cpu'
    """
    if strategy not in get_args(Strategy):
        raise ValueError(
            f"wrap_model: strategy={strategy!r} is not one of {get_args(Strategy)}; "
            "use 'auto' to follow ctx.parallelism."
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap_model: model={type(model).__name__} is not a torch.nn.Module.")
    wrapped_by = _is_wrapped(model)
    if wrapped_by is not None:
        raise ValueError(
            f"wrap_model: the model is already wrapped by {wrapped_by}; wrap the original module "
            "once (accel.unwrap_model(model) returns it)."
        )
    compile = ctx.compile if compile is None else compile
    if compile not in (False, True, "regional"):
        raise ValueError(f"wrap_model: compile={compile!r} must be False, True or 'regional'.")
    options = fsdp if fsdp is not None else ctx.fsdp
    choice = _choose(ctx, strategy, tp_plan=tp_plan, fsdp=options is not None, ddp=ddp)
    return _apply(ctx, model, choice, tp_plan, options or FSDPOptions(), ddp, compile)


def _apply(
    ctx: RunContext,
    model: nn.Module,
    choice: _Choice,
    tp_plan: Any,
    options: FSDPOptions,
    ddp: DDPOptions | None,
    compile: CompileMode,
) -> nn.Module:
    p = ctx.parallelism or Parallelism(dp_replicate=ctx.world_size)
    plan = None
    if choice.tp:
        raw = _tp.hf_plan(model) if tp_plan == "auto" else tp_plan
        plan = _tp.resolve_plan(model, raw, p.tp)
    layers = _fsdp.layer_modules(model, options.layer_classes) if options.layer_classes else []
    blocks = layers or _fsdp.repeated_blocks(model)
    if (options.activation_checkpointing or compile == "regional") and not blocks:
        raise ValueError(
            f"wrap_model: activation checkpointing and compile='regional' work per block, and "
            f"{type(model).__name__} has no nn.ModuleList of repeated blocks; name the block "
            "class: FSDPOptions(layer_classes=(Block,))."
        )
    if options.offload_params and ctx.device.type == "cpu":
        raise NotImplementedError(
            "wrap_model: FSDPOptions(offload_params=True) moves sharded parameters from an "
            "accelerator to the CPU, and this run computes on the CPU already (FSDP2 refuses "
            "it there). Drop offload_params, or run on CUDA."
        )
    fsdp_mesh = _fsdp_mesh(ctx, p) if choice.data == "fsdp2" else None
    originals = list(model.parameters())
    model.to(ctx.device)
    if options.sync_module_states and ctx.world_size > 1:
        _fsdp.sync_module_states(model, require_group(ctx, "wrap_model"))
    if plan is not None:
        _tp.apply_tp(model, _mesh_dim(ctx, "tp"), plan)
    if options.activation_checkpointing:
        _fsdp.checkpoint_activations(blocks)
    if compile == "regional":
        _fsdp.compile_blocks(blocks)
    wrapped = model
    if fsdp_mesh is not None:
        wrapped = _fsdp.apply_fsdp2(ctx, model, options, fsdp_mesh, layers=layers)
    elif choice.data == "ddp":
        group = _mesh_dim(ctx, "dp_replicate").get_group() if ctx.mesh is not None else None
        wrapped = apply_ddp(ctx, model, ddp or DDPOptions(), group=group)
    current = {id(q) for q in model.parameters()}
    for q in originals:
        if id(q) not in current:
            setattr(q, REPLACED, True)
    if compile is True:
        wrapped = torch.compile(wrapped)  # type: ignore[assignment]
    return wrapped


def _mesh_dim(ctx: RunContext, *names: str) -> Any:
    if ctx.mesh is None:
        raise RuntimeError(
            f"wrap_model: ctx.parallelism={ctx.parallelism} splits the world but the context "
            "has no DeviceMesh; build it with accel.init_distributed(parallelism=...)."
        )
    return ctx.mesh[names if len(names) > 1 else names[0]]


def _fsdp_mesh(ctx: RunContext, p: Parallelism) -> Any:
    if ctx.parallelism is None or (ctx.mesh is None and p.dp_shard * p.cp == ctx.world_size):
        return _fsdp.world_mesh(ctx)  # sharding over the whole group needs no mesh of ours
    shard = "dp_shard_cp" if p.cp > 1 and p.dp_shard > 1 else ("cp" if p.cp > 1 else "dp_shard")
    if p.dp_replicate > 1:
        return _mesh_dim(ctx, "dp_replicate", shard)  # HSDP: replicate outer, shard inner
    return _mesh_dim(ctx, shard)


def unwrap_model(model: nn.Module) -> nn.Module:
    """Return the module the user built, from inside DDP and `torch.compile` wrappers.

    Wrappers nested in any order are all removed. An FSDP2 model is its own module (sharded in
    place), so it comes back as it is.

    Args:
        model: a model, wrapped by `wrap_model` or not.

    Returns:
        The innermost module; `model` itself when it is not wrapped.

    Example:

    >>> from torch import nn
    >>> from accel import RunContext, unwrap_model, wrap_model
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

    >>> import torch
    >>> from torch import nn
    >>> from accel import check_optimizer
    >>> check_optimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, REPLACED, False):
                raise ValueError(
                    "The optimizer was created before wrap_model and holds parameters that "
                    "FSDP2 or tensor parallelism replaced, so it would train nothing. Create it "
                    "after wrapping: model = accel.wrap_model(ctx, model); "
                    "optimizer = torch.optim.AdamW(model.parameters(), ...)."
                )
