"""DDP (`torch.nn.parallel.DistributedDataParallel`) application for `wrap_model`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from torch import nn

from accel._groups import require_group
from accel.context import RunContext

CommHook = Literal["fp16", "bf16", "powersgd", "batched_powersgd"]
CommWrapper = Literal["fp16", "bf16"]
# DDPOptions fields that configure the communication hook, not DDP's constructor.
_HOOK_FIELDS = frozenset(
    {"comm_hook", "comm_wrapper", "powersgd_rank", "powersgd_start_iter",
     "powersgd_min_compression_rate"}
)  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class DDPOptions:
    """Options of `torch.nn.parallel.DistributedDataParallel` and its communication hook.

    The first five fields are DDP's own (same names and meaning). `comm_hook` registers one of
    `torch.distributed.algorithms.ddp_comm_hooks` on the wrapped model, as Accelerate's
    `DistributedDataParallelKwargs(comm_hook=..., comm_wrapper=..., comm_state_option=...)`.

    Example:
        >>> from accel import DDPOptions
        >>> DDPOptions(comm_hook="powersgd", powersgd_rank=2).powersgd_start_iter
        1000
    """

    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    # Gradient communication: None (DDP's fp32 all-reduce), "fp16"/"bf16" (cast each bucket,
    # all-reduce, cast back), "powersgd"/"batched_powersgd" (low-rank compression with error
    # feedback, per tensor or per bucket), or a torch hook `hook(process_group, bucket)`.
    comm_hook: CommHook | Callable[..., Any] | None = None
    # Compress what a PowerSGD hook sends in fp16/bf16 (Accelerate's comm_wrapper).
    comm_wrapper: CommWrapper | None = None
    # PowerSGD's matrix approximation rank (torch's matrix_approximation_rank).
    powersgd_rank: int = 1
    # Steps of plain all-reduce before compressing (the warm-up; torch's start_powerSGD_iter).
    powersgd_start_iter: int = 1_000
    # Compress a tensor only when it shrinks by at least this factor (min_compression_rate).
    powersgd_min_compression_rate: float = 2.0

    def __post_init__(self) -> None:
        hook = self.comm_hook
        if hook is not None and not callable(hook) and hook not in get_args(CommHook):
            raise ValueError(
                f"DDPOptions: comm_hook={hook!r} is not supported; expected one of "
                f"{get_args(CommHook)}, a torch hook callable or None. Accelerate's "
                "'power_sgd' is comm_hook='powersgd'."
            )
        if self.comm_wrapper is not None and self.comm_wrapper not in get_args(CommWrapper):
            raise ValueError(
                f"DDPOptions: comm_wrapper={self.comm_wrapper!r} is not supported; expected one "
                f"of {get_args(CommWrapper)} or None."
            )
        if self.comm_wrapper is not None and hook is None:
            raise ValueError(
                f"DDPOptions: comm_wrapper={self.comm_wrapper!r} wraps a hook but comm_hook=None; "
                "set comm_hook (e.g. 'powersgd') or drop comm_wrapper."
            )
        if self.powersgd_rank < 1:
            raise ValueError(
                f"DDPOptions: powersgd_rank={self.powersgd_rank} must be >= 1 (the rank of the "
                "low-rank approximation)."
            )
        # PowerSGD with error feedback needs two plain iterations first (DDP rebuilds its
        # buckets after the first): torch's PowerSGDState refuses start_powerSGD_iter <= 1.
        if self.powersgd_start_iter < 2:
            raise ValueError(
                f"DDPOptions: powersgd_start_iter={self.powersgd_start_iter} must be >= 2; "
                "PowerSGD compresses only after DDP's first two iterations."
            )


def _check_batched_powersgd(powersgd: Any) -> None:
    """Refuse torch's batched PowerSGD hook where it cannot run.

    torch 2.13's `batched_powerSGD_hook` hands `_orthogonalize` one 2-D matrix, which it
    rejects (it expects a batch of matrices), at the first compressed step: checked with gloo
    at 2 ranks. Probe that function rather than a version number, so a fixed torch is used.
    """
    import torch

    try:
        powersgd._orthogonalize(torch.ones(2, 1))
    except AssertionError as err:
        raise NotImplementedError(
            "wrap_model: DDPOptions(comm_hook='batched_powersgd') fails in this torch "
            f"({torch.__version__}): its batched_powerSGD_hook passes a 2-D matrix to "
            "_orthogonalize, which expects a batch, at the first compressed step. Use "
            "comm_hook='powersgd' (per-tensor PowerSGD)."
        ) from err


def comm_hook_state_and_fn(options: DDPOptions, group: Any) -> tuple[Any, Any] | None:
    """Return the (state, hook) pair to register on a DDP model over `group`, or None."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    hook = options.comm_hook
    if hook is None:
        return None
    state: Any = group
    if callable(hook):
        fn: Any = hook
    elif hook in ("fp16", "bf16"):
        fn = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
        fn = fn[hook]
    else:
        fn = powerSGD_hook.powerSGD_hook
        if hook == "batched_powersgd":
            _check_batched_powersgd(powerSGD_hook)
            fn = powerSGD_hook.batched_powerSGD_hook
        state = powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=options.powersgd_rank,
            start_powerSGD_iter=options.powersgd_start_iter,
            min_compression_rate=options.powersgd_min_compression_rate,
        )
    if options.comm_wrapper == "fp16":
        fn = default_hooks.fp16_compress_wrapper(fn)
    elif options.comm_wrapper == "bf16":
        fn = default_hooks.bf16_compress_wrapper(fn)
    return state, fn


def apply_ddp(
    ctx: RunContext, model: nn.Module, options: DDPOptions, *, group: Any = None
) -> nn.Module:
    """Wrap `model` in DDP over `group` (a mesh dimension's), else the context's group."""
    from torch.nn.parallel import DistributedDataParallel

    if group is None:
        group = require_group(ctx, "wrap_model")
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    # Pass only what differs from DDP's defaults, so a renamed option warns only when used.
    defaults = DDPOptions()
    kwargs: dict[str, Any] = {
        f.name: getattr(options, f.name)
        for f in dataclasses.fields(options)
        if f.name not in _HOOK_FIELDS and getattr(options, f.name) != getattr(defaults, f.name)
    }
    ddp = DistributedDataParallel(model, device_ids=device_ids, process_group=group, **kwargs)
    hook = comm_hook_state_and_fn(options, group)
    if hook is None:
        return ddp
    try:
        ddp.register_comm_hook(state=hook[0], hook=hook[1])
    except TypeError as err:
        if "bf16" not in (options.comm_hook, options.comm_wrapper):
            raise
        # torch refuses its bf16 hooks unless built with CUDA and NCCL 2.10+ (or XPU and XCCL).
        what = "comm_hook" if options.comm_hook == "bf16" else "comm_wrapper"
        raise NotImplementedError(
            f"wrap_model: DDPOptions({what}='bf16') needs torch built with CUDA and NCCL 2.10+ "
            f"(or XPU and XCCL), and this run is on {ctx.device} over {ctx.backend!r} ({err}). "
            f"Use {what}='fp16' here."
        ) from err
    return ddp
