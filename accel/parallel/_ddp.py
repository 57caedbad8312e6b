"""DDP (`torch.nn.parallel.DistributedDataParallel`) application for `wrap_model`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import nn

from accel._groups import require_group
from accel.context import RunContext


@dataclass(frozen=True, slots=True, kw_only=True)
class DDPOptions:
    """Options passed to `torch.nn.parallel.DistributedDataParallel` (same names and meaning)."""

    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = False
    static_graph: bool = False


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
        if getattr(options, f.name) != getattr(defaults, f.name)
    }
    return DistributedDataParallel(model, device_ids=device_ids, process_group=group, **kwargs)
