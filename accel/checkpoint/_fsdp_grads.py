"""The gradients an FSDP2 model holds inside an accumulation window, read and put back.

Inside a window (`set_requires_gradient_sync(False)`) FSDP2 keeps each rank's own, unreduced
sums on the *unsharded* parameters (`unsharded_accumulated_grad` when the reduce dtype differs
from the parameter's, else the unsharded parameter's `.grad`); the sharded parameters' `.grad`
stays None until the window's last backward reduce-scatters them. After a synced backward
without `zero_grad`, the sums are on the sharded parameters instead. Both are this rank's
alone, so a checkpoint keeps both per rank and restores them at the same mesh.

torch has no public API for the unsharded sums; they are read through FSDP2's `FSDPParam`
objects (checked against torch 2.13). Where a torch version keeps them elsewhere, saving and
loading raise NotImplementedError naming the version rather than dropping the gradients.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from accel._dtensor import is_dtensor

UNSHARDED = "unsharded:"
"""Key prefix of an unsharded (in-window) sum; sharded `.grad` keys are parameter names."""


def _fsdp_params(model: nn.Module) -> Iterator[tuple[nn.Module, Any]]:
    """(FSDP module, FSDPParam) for every parameter FSDP2 manages in `model`."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state: Any = getattr(module, "_get_fsdp_state", lambda: None)()
        if not hasattr(state, "_fsdp_param_group"):
            raise NotImplementedError(
                f"accel cannot find FSDP2's accumulated gradients in torch {torch.__version__} "
                "(it reads FSDP2's internals, checked against torch 2.13), so it cannot save or "
                "restore them. Save after the optimizer step and zero_grad (when accumulate "
                "yields sync=True), or use the torch version accel was tested with."
            )
        group = state._fsdp_param_group  # None for a module holding no parameters itself
        for fsdp_param in group.fsdp_params if group is not None else ():
            yield module, fsdp_param


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _unsharded_sum(fsdp_param: Any) -> torch.Tensor | None:
    accumulated = getattr(fsdp_param, "unsharded_accumulated_grad", None)
    if accumulated is not None:
        return accumulated  # type: ignore[no-any-return]
    unsharded = fsdp_param.__dict__.get("_unsharded_param")  # absent before the first forward
    return None if unsharded is None else unsharded.grad


def window_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's gradients of an FSDP2 model, as local (plain) tensors, by key.

    Sharded `.grad` values are stored under the parameter's name (the rank's shard); unsharded
    in-window sums under `UNSHARDED + name` (the whole tensor, or its tensor-parallel shard).
    """
    names = _names(model)
    grads: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads[name] = p.grad.to_local() if is_dtensor(p.grad) else p.grad
    for _, fsdp_param in _fsdp_params(model):
        total = _unsharded_sum(fsdp_param)
        if total is not None:
            name = names[id(fsdp_param.sharded_param)]
            grads[UNSHARDED + name] = total.to_local() if is_dtensor(total) else total
    return grads


def restore_window_grads(fn: str, model: nn.Module, saved: Mapping[str, torch.Tensor]) -> None:
    """Put `window_grads` output back into an FSDP2 model at the same mesh (clearing others).

    A module whose unsharded parameters do not exist yet (no forward since it was built) is
    unsharded and resharded once to create them: a collective over its mesh, which every rank
    reaches since all load the same checkpoint.
    """
    params = dict(model.named_parameters())
    for name, p in params.items():
        local = saved.get(name)
        p.grad = None if local is None else _like(fn, name, local, p)
    names = _names(model)
    for module, fsdp_param in _fsdp_params(model):
        name = names[id(fsdp_param.sharded_param)]
        local = saved.get(UNSHARDED + name)
        if local is None:
            _set_unsharded_sum(fsdp_param, None)
            continue
        if fsdp_param.__dict__.get("_unsharded_param") is None:
            module.unshard()  # type: ignore[operator]
            module.reshard()  # type: ignore[operator]
        _set_unsharded_sum(fsdp_param, _like(fn, name, local, fsdp_param._unsharded_param))


def _set_unsharded_sum(fsdp_param: Any, value: torch.Tensor | None) -> None:
    """Where FSDP2 keeps the sum: in the reduce dtype when that differs from the parameter's."""
    unsharded = fsdp_param.__dict__.get("_unsharded_param")
    reduce_dtype = getattr(fsdp_param, "reduce_dtype", None)
    upcast = unsharded is not None and reduce_dtype not in (None, unsharded.dtype)
    if value is not None and upcast and value.dtype == reduce_dtype:
        fsdp_param.unsharded_accumulated_grad, unsharded.grad = value, None
        return
    fsdp_param.unsharded_accumulated_grad = None
    if unsharded is not None:
        unsharded.grad = value


def _like(fn: str, name: str, local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`local` placed as `param`'s gradient: on its device, and a DTensor where it is one."""
    want = param.to_local() if is_dtensor(param) else param
    if tuple(local.shape) != tuple(want.shape):
        raise ValueError(
            f"{fn}: the saved gradient of {name!r} has local shape {tuple(local.shape)}, but "
            f"this rank's part of the parameter has {tuple(want.shape)}; gradients saved inside "
            "an accumulation window load only at the mesh they were saved at. Resume at that "
            "mesh, or save after an optimizer step."
        )
    local = local.to(device=want.device)
    if not is_dtensor(param):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False,
        shape=param.shape, stride=param.stride(),
    )  # fmt: skip
