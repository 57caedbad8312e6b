"""wrap_model's plan: every argument validated and every choice made before the model changes.

`make_plan` reads the context, the arguments and the model (its module names, block classes,
shapes) and returns a frozen `WrapPlan`, or raises; nothing is moved, split or wrapped until a
plan exists, so a bad argument never leaves a half-wrapped model behind. The launcher's
choices (`ctx.wrap`) are read here and only here: an argument left None takes its default.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accel._groups import require_group
from accel._mesh import check_cp, shard_mesh_name
from accel._options import CompileMode, FSDPOptions, check_compile
from accel._parallelism import Parallelism, slice_mesh
from accel.context import RunContext, along
from accel.parallel import _experts, _fsdp, _start, _tp, _ulysses
from accel.parallel._ddp import DDPOptions
from accel.parallel.deepspeed import DeepSpeedOptions

WrapStrategy = Literal["auto", "none", "ddp", "fsdp2", "deepspeed"]
"""What `wrap_model` applies: "auto" follows ctx.parallelism; the others force one wrapper."""
Data = Literal["none", "ddp", "fsdp2"]
Blocks = tuple[type[nn.Module] | str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class WrapPlan:
    """What wrap_model does to the model, step by step, in torch's order."""

    data: Data
    """The data-parallel wrapper: none, DDP or FSDP2 (HSDP on a 2-D mesh)."""
    tp_styles: Mapping[str, Any] | None
    """Module name -> torch ParallelStyle; None without tensor parallelism."""
    tp_mesh: Any
    """The 1-D tensor-parallel mesh (None without tensor parallelism)."""
    sp_modules: tuple[tuple[str, nn.Module], ...] = ()
    """(name, module) of each attention module Ulysses wraps (empty without sp)."""
    sp_group: Any = None
    """The sequence-parallel process group (None: the default group, or no sp)."""
    ep_modules: tuple[tuple[str, nn.Module, _experts.ExpertParallel], ...] = ()
    """(name, module, style) of each experts module split over ep (empty without ep)."""
    ep_mesh: Any = None
    """The 1-D expert-parallel mesh the experts' weights are sharded over."""
    ep_fsdp_mesh: Any = None
    """The mesh FSDP2 shards the experts' weights over: the data ranks that are not ep
    (dp_shard, or (dp_replicate, dp_shard)); None when there are none."""
    agree: Literal["no", "if_different", "always"]
    """Whether rank 0's weights are broadcast before splitting: never, when ranks differ, always."""
    checkpointed: tuple[nn.Module, ...]
    """Blocks whose activations are recomputed in backward."""
    compiled: tuple[nn.Module, ...]
    """Blocks compiled one by one (compile="regional")."""
    compile_whole: bool
    """torch.compile the wrapped model last (compile=True)."""
    compile_dynamic: bool | None
    """torch.compile's `dynamic=` for what is compiled (regional blocks or the whole model)."""
    fsdp: FSDPOptions
    """FSDP2's options (used when data is "fsdp2")."""
    fsdp_layers: tuple[nn.Module, ...]
    """The FSDP2 units sharded before the root."""
    fsdp_mesh: Any
    """The mesh FSDP2 shards over: 1-D, or 2-D (replicate, shard) for HSDP."""
    ddp: DDPOptions
    """DDP's options (used when data is "ddp")."""
    ddp_group: Any
    """The process group DDP replicates over; None is the context's group."""


def is_wrapped(model: nn.Module) -> str | None:
    """The wrapper around `model` (DDP, FSDP2, torch.compile), or None."""
    if isinstance(model, DistributedDataParallel):
        return "DistributedDataParallel"
    # A model is an FSDPModule only once torch.distributed.fsdp was imported, which costs
    # seconds per process (it pulls in torch._dynamo): never import it just to ask.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None and isinstance(model, fsdp.FSDPModule):
        return "FSDP2 (fully_shard)"
    if hasattr(model, "_orig_mod"):
        return "torch.compile"
    return None


def make_plan(
    ctx: RunContext,
    model: nn.Module,
    *,
    strategy: WrapStrategy,
    tp_plan: Any,
    fsdp: FSDPOptions | None,
    ddp: DDPOptions | None,
    compile: CompileMode | None,
    activation_checkpointing: bool | Blocks | None,
    sp_plan: Any = None,
    ep_plan: Any = None,
) -> WrapPlan:
    """Validate every argument against the context and the model; decide every step. An
    argument that is None takes the launcher's choice, `ctx.wrap`'s."""
    defaults = ctx.wrap
    fsdp = defaults.fsdp if fsdp is None else fsdp
    compile = check_compile("wrap_model", defaults.compile if compile is None else compile)
    if activation_checkpointing is None:  # the launcher's, or the deprecated FSDPOptions field
        activation_checkpointing = defaults.activation_checkpointing or bool(
            fsdp is not None and fsdp.activation_checkpointing
        )
    p = ctx.parallelism or Parallelism(dp_replicate=ctx.world_size)
    # Before anything that needs the mesh or the group: a context built by hand may have
    # neither, and the argument at fault is the one to name.
    check_cp("wrap_model", p, ctx.device.type, arg="ctx.parallelism")
    _tp.check_plan(tp_plan)
    data, tp = _choose(ctx, p, strategy, tp_plan=tp_plan, fsdp=fsdp, ddp=ddp)
    options = fsdp or FSDPOptions()
    styles = None
    if tp:
        raw = _tp.hf_plan(model) if tp_plan == "auto" else tp_plan
        styles = _tp.resolve_plan(model, raw, p.tp)
    sp_modules = _sp_modules(ctx, model, p, data, sp_plan)
    ep_modules = _ep_modules(p, model, data, ep_plan)
    if compile and (sp_modules or ep_modules):
        raise NotImplementedError(
            f"wrap_model: compile={compile!r} with sp={p.sp}, ep={p.ep}: the all-to-alls "
            "around attention and the experts' dispatcher have not been verified under "
            "torch.compile; use compile=False with sequence or expert parallelism."
        )
    layers = _fsdp.layer_modules(model, options.layer_classes) if options.layer_classes else []
    blocks = layers or _fsdp.repeated_blocks(model)
    checkpointed = _checkpointed(model, activation_checkpointing, blocks)
    if compile == "regional" and not blocks:
        raise ValueError(
            f"wrap_model: compile='regional' compiles each repeated block, and "
            f"{type(model).__name__} has no nn.ModuleList of repeated blocks; name the block "
            "class: FSDPOptions(layer_classes=(Block,)), or use compile=True."
        )
    if data == "fsdp2" and options.offload_params and ctx.device.type == "cpu":
        raise NotImplementedError(
            "wrap_model: FSDPOptions(offload_params=True) moves sharded parameters from an "
            "accelerator to the CPU, and this run computes on the CPU already (FSDP2 refuses "
            "it there). Drop offload_params, or run on CUDA."
        )
    meta = _start.has_meta(model)
    if meta and data == "ddp":
        raise ValueError(
            "wrap_model: the model has tensors on the meta device (built under "
            "init_empty_weights), and strategy 'ddp' replicates real weights. Load them first "
            "(accel.load_checkpoint_in_model(model, checkpoint)), or shard with "
            "Parallelism(dp_shard=...) / strategy='fsdp2' and load after wrapping."
        )
    agree: Literal["no", "if_different", "always"] = "no"
    if ctx.world_size > 1 and not meta and (tp or data == "fsdp2"):
        agree = "always" if options.sync_module_states else "if_different"
    return WrapPlan(
        data=data,
        tp_styles=styles,
        tp_mesh=mesh_dim(ctx, "tp") if tp else None,
        sp_modules=sp_modules,
        sp_group=along(ctx, "sp").process_group if sp_modules else None,
        ep_modules=ep_modules,
        ep_mesh=mesh_dim(ctx, "ep") if ep_modules else None,
        ep_fsdp_mesh=_ep_fsdp_mesh(ctx, p) if ep_modules else None,
        agree=agree,
        checkpointed=tuple(checkpointed),
        compiled=tuple(blocks) if compile == "regional" else (),
        compile_whole=compile is True,
        compile_dynamic=defaults.compile_dynamic,
        fsdp=options,
        fsdp_layers=tuple(layers),
        fsdp_mesh=_fsdp_mesh(ctx, p) if data == "fsdp2" else None,
        ddp=ddp or DDPOptions(),
        ddp_group=_ddp_group(ctx) if data == "ddp" else None,
    )


def deepspeed_plan(
    ctx: RunContext, strategy: WrapStrategy, options: Any, *others: Any
) -> DeepSpeedOptions | None:
    """The options DeepSpeed's engine is built from (its config the launcher's when none is
    given), or None when wrap_model applies no DeepSpeed; `others` are the options of the
    other strategies (fsdp=, ddp=, tp_plan=, compile=, fp8=, sp_plan=, ep_plan=), refused
    beside DeepSpeed."""
    if strategy == "auto" and ctx.wrap.deepspeed is not None:
        strategy = "deepspeed"  # the launcher asked for DeepSpeed (distributed_type DEEPSPEED)
    if strategy != "deepspeed" and (options is None or options.config is None):
        return None
    if strategy != "deepspeed" or not isinstance(options, DeepSpeedOptions):
        raise ValueError(
            f"wrap_model: strategy={strategy!r} with deepspeed={options!r}; DeepSpeed needs "
            "both: strategy='deepspeed' (or 'auto' under a DeepSpeed launch), "
            "deepspeed=accel.DeepSpeedOptions(config=..., optimizer=...)."
        )
    if options.config is None and ctx.wrap.deepspeed is None:
        raise ValueError(
            "wrap_model: DeepSpeedOptions(config=None) takes the launcher's DeepSpeed config, "
            "and ctx.wrap.deepspeed is None (not launched with distributed_type DEEPSPEED); "
            "pass config={'zero_stage': 2} (or a DeepSpeed JSON), or launch with "
            "--use_deepspeed."
        )
    if any(o is not None for o in others):
        raise ValueError(
            "wrap_model: strategy='deepspeed' takes no fsdp=, ddp=, tp_plan=, compile=, fp8=, "
            "sp_plan= or ep_plan= options (the DeepSpeed config says how the engine shards); "
            "drop them."
        )
    if ctx.sp_size > 1 or ctx.ep_size > 1:
        raise NotImplementedError(
            f"wrap_model: strategy='deepspeed' with ctx.parallelism={ctx.parallelism}; accel's "
            "sequence (sp) and expert (ep) parallelism compose with FSDP2, not with DeepSpeed's "
            "engine. Use sp=1 and ep=1 with DeepSpeed, or strategy='auto' (FSDP2)."
        )
    if options.config is not None:
        return options
    return dataclasses.replace(options, config=dict(ctx.wrap.deepspeed or ()))


def _choose(
    ctx: RunContext,
    p: Parallelism,
    strategy: WrapStrategy,
    *,
    tp_plan: Any,
    fsdp: FSDPOptions | None,
    ddp: DDPOptions | None,
) -> tuple[Data, bool]:
    """(data-parallel wrapper, tensor parallel or not); raise for what cannot hold."""
    if strategy not in get_args(WrapStrategy):
        raise ValueError(
            f"wrap_model: strategy={strategy!r} is not one of {get_args(WrapStrategy)}; "
            "use 'auto' to follow ctx.parallelism."
        )
    sharded = shard_mesh_name(p) is not None  # dp_shard, ep, cp or sp > 1
    data: Data
    if strategy == "auto":
        data = "fsdp2" if sharded else ("ddp" if p.dp_replicate > 1 else "none")
    else:
        data = cast(Data, strategy)  # wrap_model takes "deepspeed" before any plan
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
    if tp and isinstance(tp_plan, Mapping) and not tp_plan:
        # An empty plan would split nothing and leave tp ranks holding whole replicas that
        # no collective keeps in step: silently not tensor parallel.
        raise ValueError(
            f"wrap_model: tp_plan={{}} names no module to split, and ctx.parallelism has "
            f"tp={p.tp}; expected at least one pattern, e.g. "
            "tp_plan={'layers.*.attention.wq': 'colwise'}, or tp_plan='auto' for a Hugging Face "
            "model. To train without tensor parallelism use Parallelism(tp=1)."
        )
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
    if fsdp is not None and data != "fsdp2":
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
        fix = (
            f"Shard instead: Parallelism(dp_shard={p.dp_replicate}, tp={p.tp}) applies FSDP2 "
            "with TP."
            if p.dp_replicate > 1
            else "With dp_replicate=1 there is nothing to replicate: use strategy='auto' "
            "(tensor parallelism alone)."
        )
        raise NotImplementedError(
            f"wrap_model: DDP over dp_replicate={p.dp_replicate} with tp={p.tp} is not "
            f"supported (strategy={strategy!r}; DDP cannot reduce tensor-parallel DTensor "
            f"gradients). {fix}"
        )
    return data, tp


def _sp_modules(
    ctx: RunContext, model: nn.Module, p: Parallelism, data: Data, sp_plan: Any
) -> tuple[tuple[str, nn.Module], ...]:
    """The attention modules Ulysses wraps; refuse a plan without sp, sp without a plan."""
    if p.sp == 1:
        if sp_plan is not None:
            raise ValueError(
                f"wrap_model: sp_plan was given but ctx.parallelism={p} has sp=1 (nothing to "
                "split); build the context with Parallelism(sp=...), or drop sp_plan."
            )
        return ()
    if sp_plan is None:
        raise ValueError(
            f"wrap_model: ctx.parallelism has sp={p.sp} but sp_plan=None; name the attention "
            "modules whose scaled_dot_product_attention Ulysses wraps, e.g. "
            "sp_plan=('layers.*.attention',), or sp_plan='auto' for a transformers model."
        )
    if p.cp > 1:
        # torch's context_parallel rewrites the same SDPA call into ring attention; with the
        # all-to-alls around it (sp inside, cp outside) the two have not been run together on
        # CUDA here, so the pair is refused rather than trusted.
        raise NotImplementedError(
            f"wrap_model: sp={p.sp} with cp={p.cp} is not supported yet (Ulysses inside ring "
            "attention has not been verified on CUDA); use one of them: fold the cp ranks into "
            "sp (any device), or sp=1."
        )
    if data != "fsdp2":
        raise ValueError(
            f"wrap_model: sp={p.sp} needs FSDP2 over the ranks holding replicated parameters "
            f"(their gradients are reduced over sp too), and the strategy applies {data!r}. "
            "Use strategy='auto'."
        )
    names = _ulysses.resolve_plan(model, sp_plan, sp=p.sp, tp=p.tp)
    modules = dict(model.named_modules())
    return tuple((name, modules[name]) for name in names)


def _ep_modules(
    p: Parallelism, model: nn.Module, data: Data, ep_plan: Any
) -> tuple[tuple[str, nn.Module, _experts.ExpertParallel], ...]:
    """The experts modules split over ep; refuse a plan without ep, ep without a plan."""
    if p.ep == 1:
        if ep_plan is not None:
            raise ValueError(
                f"wrap_model: ep_plan was given but ctx.parallelism={p} has ep=1 (nothing to "
                "split); build the context with Parallelism(ep=...), or drop ep_plan."
            )
        return ()
    if ep_plan is None:
        raise ValueError(
            f"wrap_model: ctx.parallelism has ep={p.ep} but ep_plan=None; name the experts "
            "modules to split, e.g. ep_plan={'layers.*.moe.experts': my_expert_fn}, or "
            "ep_plan='auto' for transformers' Mixtral / Qwen-MoE experts."
        )
    others = [f"{n}={getattr(p, n)}" for n in ("pp", "cp", "sp", "tp") if getattr(p, n) > 1]
    if others:
        raise NotImplementedError(
            f"wrap_model: ep={p.ep} with {', '.join(others)} is not supported: accel's expert "
            "parallelism composes with dp_shard and dp_replicate (the data dimensions). Fold "
            "those ranks into dp_shard, or use ep=1."
        )
    if data != "fsdp2":
        raise ValueError(
            f"wrap_model: ep={p.ep} needs FSDP2 over the ranks holding the replicated (non-expert) "
            f"parameters, and the strategy applies {data!r}. Use strategy='auto'."
        )
    modules = dict(model.named_modules())
    return tuple((n, modules[n], style) for n, style in _experts.resolve_plan(model, ep_plan, p.ep))


def _ep_fsdp_mesh(ctx: RunContext, p: Parallelism) -> Any:
    """The data ranks that are not ep: FSDP2 shards expert weights over them, never over ep."""
    dims = tuple(n for n in ("dp_replicate", "dp_shard") if getattr(p, n) > 1)
    return mesh_dim(ctx, *dims) if dims else None


def _checkpointed(
    model: nn.Module, value: bool | Blocks, blocks: list[nn.Module]
) -> list[nn.Module]:
    """The blocks activation checkpointing recomputes: none, the repeated blocks, or by class."""
    if value is False:
        return []
    if value is True:
        if not blocks:
            raise ValueError(
                f"wrap_model: activation_checkpointing=True recomputes each repeated block, and "
                f"{type(model).__name__} has no nn.ModuleList of repeated blocks; name the "
                "block class: activation_checkpointing=(Block,) (or the class name)."
            )
        return blocks
    if isinstance(value, tuple) and value:
        if not all(isinstance(c, str) or (isinstance(c, type) and issubclass(c, nn.Module))
                   for c in value):  # fmt: skip
            raise TypeError(_AC_ALLOWED.format(value=value))
        return _fsdp.layer_modules(model, value, name="activation_checkpointing")
    raise TypeError(_AC_ALLOWED.format(value=value))


_AC_ALLOWED = (
    "wrap_model: activation_checkpointing={value!r} must be True, False, None (the launcher's "
    "setting) or a non-empty tuple of block classes or class names. Use "
    "activation_checkpointing=True, or activation_checkpointing=(Block,)."
)


def mesh_dim(ctx: RunContext, *names: str) -> Any:
    """The named dimension(s) of the context's DeviceMesh; raise when it has none."""
    if ctx.mesh is None:
        raise RuntimeError(
            f"wrap_model: ctx.parallelism={ctx.parallelism} splits the world but the context "
            "has no DeviceMesh; build it with accel.init_distributed(parallelism=...)."
        )
    return slice_mesh(ctx.mesh, ctx.parallelism or Parallelism(), names)


def agree_group(ctx: RunContext) -> Any:
    """The ranks that hold the same model: the world, or (pp > 1) one pipeline stage's peers."""
    if ctx.pp_size == 1:
        return require_group(ctx, "wrap_model")
    assert ctx.parallelism is not None  # pp > 1 is only ever set through parallelism
    rest = tuple(n for n in ctx.parallelism.names() if n != "pp")
    if len(rest) == 1:
        return mesh_dim(ctx, rest[0]).get_group()
    # init_distributed flattened these dimensions into "stage" already, so this returns that
    # mesh (no new group); slicing "stage" from the root mesh is deprecated in torch 2.11+.
    return mesh_dim(ctx, *rest)._flatten("stage").get_group()


def _ddp_group(ctx: RunContext) -> Any:
    return mesh_dim(ctx, "dp_replicate").get_group() if ctx.mesh is not None else None


def _fsdp_mesh(ctx: RunContext, p: Parallelism) -> Any:
    across = p.dp_shard * p.ep * p.cp * p.sp
    if ctx.parallelism is None or (ctx.mesh is None and across == ctx.world_size):
        return _fsdp.world_mesh(ctx)  # sharding over the whole group needs no mesh of ours
    shard = shard_mesh_name(p)
    assert shard is not None  # data == "fsdp2" shards over something
    if p.dp_replicate > 1:
        return mesh_dim(ctx, "dp_replicate", shard)  # HSDP: replicate outer, shard inner
    return mesh_dim(ctx, shard)
