"""What every rank's model starts from, before tensor parallelism and FSDP2 split it.

Both keep each rank's own slice of the weights it holds (FSDP2 never broadcasts; a layer that
tensor parallelism leaves whole stays each rank's own), so ranks that initialised differently
(a per-rank seed) would train one model stitched from several initialisations. DDP broadcasts
rank 0's weights when it wraps; `agree` gives the other strategies the same start, and costs
one small collective when the ranks agree already (the usual case: one seed everywhere).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from accel._groups import comm_device
from accel.context import RunContext

_SAMPLES = 64  # values sampled per tensor, spread over it, besides its sum


def has_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer is on the meta device (built under init_empty_weights)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def place(model: nn.Module, device: torch.device) -> None:
    """Move the model's real tensors to `device` in place; meta tensors stay meta.

    A model built under `init_empty_weights` is filled later (load_checkpoint_in_model fills a
    sharded meta model rank by rank), and `Module.to` cannot copy out of a meta tensor.
    """
    tensors = (*model.parameters(), *model.buffers())
    if all(t.device == device for t in tensors):
        return  # nothing to move (and a model of fake tensors cannot be swapped in place)
    if not has_meta(model):
        model.to(device)
        return
    with torch.no_grad():
        for module in model.modules():
            for param in module.parameters(recurse=False):
                if not param.is_meta:
                    param.data = param.data.to(device)  # the same Parameter, as Module.to keeps
            for name, buffer in module.named_buffers(recurse=False):
                if not buffer.is_meta:
                    setattr(module, name, buffer.to(device))


def _fingerprint(model: nn.Module, device: torch.device) -> torch.Tensor:
    """Per tensor: its sum and values sampled across it (float64), one vector for the model."""
    parts = []
    for t in (*model.parameters(), *model.buffers()):
        x = t.detach()
        if x.is_complex():
            x = torch.view_as_real(x)
        flat = x.reshape(-1)
        step = max(1, flat.numel() // _SAMPLES)
        parts.append(flat.sum(dtype=torch.float64).reshape(1))
        parts.append(flat[::step][:_SAMPLES].to(torch.float64))
    if not parts:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.nan_to_num(torch.cat([p.to(device) for p in parts]), nan=0.0)


def weights_differ(ctx: RunContext, model: nn.Module, group: Any) -> bool:
    """Whether any two ranks of `group` hold different parameters or buffers (one all-reduce).

    A model of fake tensors (`estimate_memory`'s) holds no values: nothing to compare.
    """
    if any(is_fake(t) for t in model.parameters()):
        return False
    mine = _fingerprint(model, comm_device(ctx))
    both = torch.cat([mine, -mine])  # max of x and of -x: every rank learns the max and the min
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, low = both[: mine.numel()], -both[mine.numel() :]
    return not torch.equal(high, low)


def broadcast_weights(model: nn.Module, group: Any) -> None:
    """Broadcast rank 0's parameters and buffers over `group` (Accelerate's sync_module_states)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=src, group=group)
