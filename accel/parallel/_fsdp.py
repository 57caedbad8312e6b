"""FSDP2 (`fully_shard`) and activation checkpointing for `wrap_model`."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from accel._groups import require_group
from accel._options import FSDPOptions
from accel._typing import COMPUTE_DTYPES
from accel.context import RunContext

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# Attribute set on parameters that FSDP2 or tensor parallelism replaced: an optimizer still
# holding them would update tensors the model no longer uses.
REPLACED = "_accel_replaced_by_fsdp2"


def world_mesh(ctx: RunContext) -> DeviceMesh:
    """A 1-D mesh over the context's whole group (FSDP2 without a `Parallelism`)."""
    from torch.distributed.device_mesh import DeviceMesh

    if ctx.world_size == 1 and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "wrap_model: strategy='fsdp2' needs a process group, and this single process has "
            "none. With one process use strategy='none' (nothing to shard), or run under "
            "accel.testing.run_world / accel launch, which create one."
        )
    group = require_group(ctx, "wrap_model")
    if group is None:
        group = dist.group.WORLD
    return DeviceMesh.from_group(group, ctx.device.type)


def layer_modules(
    model: nn.Module,
    classes: tuple[type[nn.Module] | str, ...],
    *,
    name: str = "layer_classes",
) -> list[nn.Module]:
    """The submodules of `model` whose class is in `classes` (classes or class names).

    Raises naming each class (or name) that matches nothing: a policy that wraps nothing would
    leave the whole model one unit, silently.
    """
    found = [m for m in model.modules() if m is not model and _is_layer(m, classes)]
    for c in classes:
        if not any(_is_layer(m, (c,)) for m in found):
            shown = c if isinstance(c, str) else c.__name__
            present = sorted({type(m).__name__ for m in model.modules()})
            what = "layer class" if name == "layer_classes" else f"{name} class"
            example = (
                "FSDPOptions(layer_classes"
                if name == "layer_classes"
                else f"wrap_model(..., {name}"
            )
            raise ValueError(
                f"wrap_model: {what} {shown!r} matches no submodule of "
                f"{type(model).__name__}; its module classes are {present}. Name the class of "
                f"the repeated block, e.g. {example}=('LlamaDecoderLayer',))."
            )
    return found


def _is_layer(module: nn.Module, classes: tuple[type[nn.Module] | str, ...]) -> bool:
    return any(
        type(module).__name__ == c if isinstance(c, str) else isinstance(module, c) for c in classes
    )


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The members of every nn.ModuleList whose members share one class (transformer blocks)."""
    blocks: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(b) for b in m}) == 1:
            blocks.extend(m)
    return blocks


def checkpoint_activations(blocks: list[nn.Module]) -> None:
    """Recompute each block's forward in backward (non-reentrant `torch.utils.checkpoint`).

    The block's own `forward` is replaced on the instance, so parameter names, state dicts and
    hooks registered on the block (FSDP2's unshard) stay as they were, outside the region.
    """
    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        inner = block.forward

        @functools.wraps(inner)
        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward


def mixed_precision(ctx: RunContext, options: FSDPOptions) -> Any:
    """FSDP2's MixedPrecisionPolicy: options first, else from ctx.precision."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param = options.param_dtype or COMPUTE_DTYPES.get(ctx.precision)
    reduce = options.reduce_dtype
    if reduce is None and param is not None and param != torch.float32:
        reduce = torch.float32  # reduce gradients in full precision: sums of many lose bits
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)


def apply_fsdp2(
    ctx: RunContext,
    model: nn.Module,
    options: FSDPOptions,
    mesh: DeviceMesh,
    *,
    layers: list[nn.Module],
    ignored: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard each layer module, then the root, over `mesh` (1-D FSDP, 2-D HSDP); `ignored`
    parameters stay as they are (expert weights split over ep and nothing else)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    shard: Any = functools.partial(
        fully_shard,
        mesh=mesh,
        reshard_after_forward=options.reshard_after_forward,
        mp_policy=mixed_precision(ctx, options),
        offload_policy=CPUOffloadPolicy() if options.offload_params else OffloadPolicy(),
        ignored_params=ignored or None,
    )
    for layer in layers:
        shard(layer)
    shard(model)
    return model
