"""Wrap a model for the run: tensor parallel, activation checkpointing, compile, FSDP2 or DDP.

`wrap_model(ctx, model)` follows `ctx.parallelism` (or the strategy you name) and returns the
model to train; `unwrap_model(model)` gives back the module the user built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accel._options import CompileMode, FSDPOptions
from accel.context import RunContext
from accel.parallel import _experts, _float8, _fsdp, _start, _tp, _ulysses
from accel.parallel._ddp import DDPOptions, apply_ddp
from accel.parallel._experts import ExpertParallel
from accel.parallel._float8 import Float8Options
from accel.parallel._fsdp import REPLACED
from accel.parallel._pipeline import PipelineStages, pipeline_stages, pipeline_step
from accel.parallel._plan import (
    WrapPlan,
    WrapStrategy,
    agree_group,
    deepspeed_plan,
    is_wrapped,
    make_plan,
)
from accel.parallel.deepspeed import DeepSpeedOptions, deepspeed_engine

__all__ = [
    "DDPOptions",
    "ExpertParallel",
    "FSDPOptions",
    "Float8Options",
    "PipelineStages",
    "check_optimizer",
    "pipeline_stages",
    "pipeline_step",
    "unwrap_model",
    "wrap_model",
]


def wrap_model(
    ctx: RunContext,
    model: nn.Module,
    *,
    strategy: WrapStrategy = "auto",
    tp_plan: Mapping[str, Any] | Literal["auto"] | None = None,
    fsdp: FSDPOptions | None = None,
    ddp: DDPOptions | None = None,
    compile: CompileMode | None = None,
    activation_checkpointing: bool | tuple[type[nn.Module] | str, ...] | None = None,
    fp8: Float8Options | None = None,
    deepspeed: DeepSpeedOptions | None = None,
    sp_plan: Literal["auto"] | tuple[str, ...] | None = None,
    ep_plan: Literal["auto"] | Mapping[str, Any] | None = None,
) -> nn.Module:
    """Move `model` to `ctx.device` and parallelize it for training; use the return value.

    `strategy="auto"` follows `ctx.parallelism`: tensor parallel when tp > 1 (by `tp_plan`),
    FSDP2 over dp_shard when dp_shard > 1 (HSDP over (dp_replicate, dp_shard) when both are
    > 1), else DDP over dp_replicate when > 1, else device placement only. Without a
    `Parallelism` every rank is a replica (DDP). "none", "ddp" and "fsdp2" force one wrapper.

    With sp > 1 (Ulysses sequence parallelism), the attention modules `sp_plan` names run
    their `scaled_dot_product_attention` over the whole sequence for heads / sp of the heads
    (an all-to-all before and after), and FSDP2 shards over dp_shard x sp, since sp ranks hold
    the same parameters.

    With ep > 1 (expert parallelism), each experts module `ep_plan` names keeps
    num_experts / ep of its experts on each ep rank (DTensors sharded on dim 0) and sends each
    routed token to the rank holding its expert and back (all-to-alls); FSDP2 shards the
    experts' weights over dp_shard only, and the other parameters over dp_shard x ep.

    Every argument is validated into a plan first; then the steps run in torch's order: place
    on the device, agree on the initial weights, tensor parallel, sequence parallel,
    activation checkpointing, regional compile, FSDP2 (or DDP), whole-model compile. Under
    tensor parallelism and FSDP2, ranks whose initial weights differ (a per-rank seed) all
    start from rank 0's, as DDP's broadcast gives (checking costs one small all-reduce). A
    model built under `init_empty_weights` stays on meta, sharded, for
    `load_checkpoint_in_model` to fill.
    Create the optimizer from the returned model's parameters: tensor parallel and FSDP2
    replace them (in place: `unwrap_model` returns your module).

    Args:
        ctx: the run's context; its mesh supplies the groups.
        model: the module to train.
        strategy: "auto", "none", "ddp" or "fsdp2".
        tp_plan: module-name patterns ('*' is one name segment) to "colwise", "rowwise" or a
            torch ParallelStyle; or "auto" for a Hugging Face model's `base_model_tp_plan`.
        fsdp: FSDP2 options (layer classes, reshard, mixed precision); default `ctx.wrap.fsdp`,
            the launcher config's.
        ddp: DistributedDataParallel options and its communication hook (`comm_hook`).
        compile: False, True (whole model, last) or "regional" (each repeated block, before
            sharding); default `ctx.wrap.compile`. Traced with `dynamic=ctx.wrap.compile_dynamic`.
        activation_checkpointing: recompute blocks' activations in backward (non-reentrant
            `torch.utils.checkpoint`), under any strategy: True for each repeated block (the
            FSDP layer classes when given, else the members of each nn.ModuleList of one
            class), a tuple of block classes (or class names), or False; default
            `ctx.wrap.activation_checkpointing`, the launcher config's.
        fp8: which Linear layers torchao's float8 training converts when
            `ctx.precision == "fp8"` (before tensor parallel and FSDP2); default
            `Float8Options()`: dims multiples of 16, large enough to gain from float8
            (torchao's size thresholds), not the output head.
        deepspeed: with strategy="deepspeed", the DeepSpeed config and your optimizer
            (`DeepSpeedOptions`); the returned model is the DeepSpeed engine, and
            `accumulate`, `optimizer_step` and `clip_grad_norm_` route to it.
        sp_plan: with sp > 1, the attention modules that call
            `scaled_dot_product_attention` on (batch, heads, seq, head_dim) tensors: a tuple
            of module-name patterns ('*' is one name segment), or "auto" for transformers'
            Llama, Mistral, Mixtral, GPT-2 and Qwen attention classes (attn_implementation
            "sdpa").
        ep_plan: with ep > 1, the experts modules (`num_experts` weights stacked on dim 0,
            an attribute `num_experts`, called as
            `experts(tokens, top_k_index, top_k_weights)`): a dict of module-name pattern ->
            "gate_up_down" (transformers' layout), a function `fn(module, weights, tokens)`
            computing one expert, or `ExpertParallel(expert_fn=..., capacity_factor=...)`; or
            "auto" for transformers' Mixtral and Qwen-MoE experts.

    Returns:
        The model to train: the module itself (strategy "none", tensor parallel or FSDP2, all
        applied in place), or a DDP wrapper, and with `compile=True`, `torch.compile`'s
        module around that.

    Raises:
        ValueError: for an unknown `strategy`, a model that is already wrapped, options for
            another strategy, a strategy or plan that contradicts `ctx.parallelism`, a tp plan
            that is empty or names no module, a tp size not dividing a split dimension, a layer
            or block class matching nothing, a meta model under DDP, "fsdp2" without a
            process group, or (sp, ep) a missing plan, a pattern naming nothing, heads or
            experts the size does not divide.
        TypeError: for a `model` that is not an `nn.Module`, a `tp_plan` that is not a dict of
            str patterns, or an `activation_checkpointing` of another type.
        NotImplementedError: for DDP combined with tensor parallelism, offload_params on a
            CPU run, context parallelism (cp > 1) off CUDA, (fp8) a tp style torchao has no
            float8 twin of, sp with cp, ep with pp, cp, sp or tp, compile with sp or ep, or a
            transformers attention Ulysses cannot wrap (not sdpa, sliding window).
        ImportError: for ctx.precision="fp8" without torchao (the `fp8` extra).
        RuntimeError: for "ddp" when no process group is initialised, or a split world
            without a DeviceMesh.

    Example:

    >>> from torch import nn
    >>> from accel import RunContext, unwrap_model, wrap_model
    >>> m = wrap_model(RunContext.single(), nn.Linear(2, 2))
    >>> unwrap_model(m).weight.device.type
    'cpu'
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap_model: model={type(model).__name__} is not a torch.nn.Module.")
    wrapped_by = is_wrapped(model)
    if wrapped_by is not None:
        raise ValueError(
            f"wrap_model: the model is already wrapped by {wrapped_by}; wrap the original module "
            "once (accel.unwrap_model(model) returns it)."
        )
    ds = deepspeed_plan(
        ctx, strategy, deepspeed, fsdp, ddp, tp_plan, compile, fp8, sp_plan, ep_plan
    )
    if ds is not None:
        from accel.parallel import _deepspeed  # on use: it imports deepspeed

        return _deepspeed.apply_deepspeed(ctx, model, ds)
    plan = make_plan(
        ctx,
        model,
        strategy=strategy,
        tp_plan=tp_plan,
        fsdp=fsdp,
        ddp=ddp,
        compile=compile,
        activation_checkpointing=activation_checkpointing,
        sp_plan=sp_plan,
        ep_plan=ep_plan,
    )
    fp8_plan, plan = _float8.plan_float8(ctx, model, fp8, plan)
    return _apply(ctx, model, plan, fp8_plan)


def _apply(
    ctx: RunContext, model: nn.Module, plan: WrapPlan, fp8_plan: _float8.Float8Plan | None
) -> nn.Module:
    """Run the plan's steps in torch's order; each step does nothing when the plan says so."""
    originals = list(model.parameters())
    _start.place(model, ctx.device)
    if plan.agree != "no":
        group = agree_group(ctx)
        if plan.agree == "always" or _start.weights_differ(ctx, model, group):
            _start.broadcast_weights(model, group)
    if fp8_plan is not None:
        _float8.convert(model, fp8_plan)
    if plan.tp_styles is not None:
        _tp.apply_tp(model, plan.tp_mesh, dict(plan.tp_styles))
    for name, module in plan.sp_modules:  # before checkpointing: recomputation runs it too
        _ulysses.ulysses(module, name, plan.sp_group, ctx.sp_size)
    for _, module, style in plan.ep_modules:
        _experts.shard_experts(module, plan.ep_mesh)
        _experts.dispatch(module, style, plan.ep_mesh.get_group(), ctx.ep_size, ctx.device)
    _fsdp.checkpoint_activations(list(plan.checkpointed))
    for block in plan.compiled:  # regional: each block in place, one graph reused per block
        block.compile(dynamic=plan.compile_dynamic)
    wrapped = model
    if plan.data == "fsdp2":
        # Experts first, in a unit of their own over the data ranks that are not ep (never
        # over ep twice); with none, the other units leave their weights out.
        ignored: set[nn.Parameter] = set()
        for _, module, _ in plan.ep_modules:
            if plan.ep_fsdp_mesh is not None:
                _fsdp.apply_fsdp2(ctx, module, plan.fsdp, plan.ep_fsdp_mesh, layers=[])
            else:
                ignored.update(module.parameters())
        wrapped = _fsdp.apply_fsdp2(
            ctx, model, plan.fsdp, plan.fsdp_mesh, layers=list(plan.fsdp_layers), ignored=ignored
        )
    elif plan.data == "ddp":
        wrapped = apply_ddp(ctx, model, plan.ddp, group=plan.ddp_group)
    if fp8_plan is not None and fp8_plan.precompute:
        _float8.precompute_before_forward(model)
    current = {id(q) for q in model.parameters()}
    for q in originals:
        if id(q) not in current:
            setattr(q, REPLACED, True)
    if plan.compile_whole:
        wrapped = torch.compile(wrapped, dynamic=plan.compile_dynamic)  # type: ignore[assignment]
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
        if inner is None and deepspeed_engine(model) is model:
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
