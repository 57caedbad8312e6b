"""Forward hooks that bring offloaded weights to the execution device for one forward.

A module whose weights live on "cpu" or "disk" keeps meta (or CPU) placeholders; a pre-hook
puts the real tensors in place on the execution device, and a post-hook puts the placeholders
back, so only one offloaded module's weights are materialised at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from accel._tree import send_to_device
from accel.big_model._offload import DiskTensor

ATTR = "_accel_offload_hooks"


@dataclass(frozen=True, slots=True)
class Slot:
    """One tensor attribute of a module and where its value lives while not in use."""

    module: nn.Module
    """The module holding the attribute."""
    attr: str
    """The parameter or buffer name inside `module`."""
    is_param: bool
    """True for a parameter, False for a buffer."""
    source: torch.Tensor | DiskTensor
    """The value: a CPU tensor, or bytes on disk mapped lazily."""
    placeholder: torch.Tensor
    """What the attribute holds between forwards (meta for disk, the CPU tensor for cpu)."""
    requires_grad: bool
    """Copied onto the parameter put in place."""

    def wrap(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` as this attribute's kind of value (a Parameter for a parameter)."""
        if self.is_param and not isinstance(tensor, nn.Parameter):
            return nn.Parameter(tensor, self.requires_grad)
        return tensor

    def put(self, value: torch.Tensor) -> None:
        """Set the attribute to `value` without nn.Module's checks (hot path)."""
        if self.is_param:
            self.module._parameters[self.attr] = value  # type: ignore[assignment]
        else:
            self.module._buffers[self.attr] = value


def _materialise(slots: Sequence[Slot], device: torch.device | None) -> None:
    """Put each slot's real value in place, once per shared source (tied weights stay tied)."""
    values: dict[int, torch.Tensor] = {}
    for slot in slots:
        value = values.get(id(slot.source))
        if value is None:
            source = slot.source
            tensor = source.load() if isinstance(source, DiskTensor) else source
            if device is None:  # for good: copy disk bytes into memory
                tensor = tensor.clone() if isinstance(source, DiskTensor) else tensor
            else:
                tensor = tensor.to(device)
            value = values[id(slot.source)] = slot.wrap(tensor)
        slot.put(value)


@dataclass(frozen=True, slots=True)
class _Record:
    slots: tuple[Slot, ...]
    handles: tuple[RemovableHandle, ...]


def attach(module: nn.Module, slots: Sequence[Slot], device: torch.device) -> None:
    """Hook `module` so that `slots` hold real tensors on `device` during its forward."""
    slots = tuple(slots)

    def pre(_: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        _materialise(slots, device)
        return send_to_device(args, device), send_to_device(kwargs, device)

    def post(_: nn.Module, __: Any, output: Any) -> Any:
        for slot in slots:
            slot.put(slot.placeholder)
        return output

    handles = (
        module.register_forward_pre_hook(pre, with_kwargs=True),
        module.register_forward_hook(post),
    )
    for slot in slots:
        slot.put(slot.placeholder)
    records = getattr(module, ATTR, ())
    object.__setattr__(module, ATTR, (*records, _Record(slots, handles)))


def attach_input_move(module: nn.Module, device: torch.device) -> None:
    """Hook `module` so its inputs are moved to `device` (a module on a second accelerator)."""

    def pre(_: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return send_to_device(args, device), send_to_device(kwargs, device)

    handle = module.register_forward_pre_hook(pre, with_kwargs=True)
    records = getattr(module, ATTR, ())
    object.__setattr__(module, ATTR, (*records, _Record((), (handle,))))


def remove_hooks(model: nn.Module) -> nn.Module:
    """Remove accel's offload hooks from `model`, putting offloaded weights back on the CPU.

    Weights that were on disk are read into memory, so the model works without hooks
    afterwards (and needs the memory they take).

    Args:
        model: a model given to `dispatch_checkpoint`, `cpu_offload` or `disk_offload`.

    Returns:
        The same model, without hooks.

    Example:
        >>> import torch, accel
        >>> model = accel.cpu_offload(torch.nn.Linear(2, 2), execution_device="cpu")
        >>> model = accel.remove_hooks(model)
        >>> model.weight.device
        device(type='cpu')
    """
    slots: list[Slot] = []
    for module in model.modules():
        for record in getattr(module, ATTR, ()):
            for handle in record.handles:
                handle.remove()
            slots += record.slots
        if hasattr(module, ATTR):
            object.__delattr__(module, ATTR)
    _materialise(slots, None)  # all at once, so tied weights get one shared value
    return model
