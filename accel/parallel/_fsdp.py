"""FSDP2 (`torch.distributed.fsdp.fully_shard`) application for `wrap_model`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from accel._groups import require_group
from accel.context import RunContext

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# Attribute set on parameters that FSDP2 replaced by sharded ones: an optimizer still holding
# them would update tensors the model no longer uses.
REPLACED = "_accel_replaced_by_fsdp2"


@dataclass(frozen=True, slots=True, kw_only=True)
class FSDPOptions:
    """How `fully_shard` is applied.

    `layer_classes`: every submodule of these classes becomes its own FSDP2 unit (the usual
    per-transformer-block policy), sharded before the root. `reshard_after_forward`: free the
    gathered parameters after forward (less memory, one more all-gather in backward).
    """

    layer_classes: tuple[type[nn.Module], ...] = ()
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        bad = [
            c for c in self.layer_classes if not (isinstance(c, type) and issubclass(c, nn.Module))
        ]
        if bad:
            raise ValueError(
                f"FSDPOptions: layer_classes contains {bad!r}; pass nn.Module subclasses, e.g. "
                "layer_classes=(TransformerBlock,)."
            )


def _mesh(ctx: RunContext) -> DeviceMesh:
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


def apply_fsdp2(ctx: RunContext, model: nn.Module, options: FSDPOptions) -> nn.Module:
    """Shard each `options.layer_classes` module, then the root, on ctx's devices."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if ctx.precision == "fp16":
        raise NotImplementedError(
            "wrap_model: strategy='fsdp2' with precision='fp16' is not supported: "
            "torch.amp.GradScaler cannot check DTensor gradients for inf across shards. "
            "Use precision='bf16' (no scaler needed) or strategy='ddp'."
        )
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if ctx.precision == "bf16"
        else MixedPrecisionPolicy()
    )
    originals = list(model.parameters())
    model.to(ctx.device)
    mesh = _mesh(ctx)
    layers = [m for m in model.modules() if m is not model and isinstance(m, options.layer_classes)]
    for layer in layers:
        fully_shard(
            layer,
            mesh=mesh,
            reshard_after_forward=options.reshard_after_forward,
            mp_policy=policy,
        )
    fully_shard(
        model,
        mesh=mesh,
        reshard_after_forward=options.reshard_after_forward,
        mp_policy=policy,
    )
    current = {id(p) for p in model.parameters()}
    for p in originals:
        if id(p) not in current:
            setattr(p, REPLACED, True)
    return model
