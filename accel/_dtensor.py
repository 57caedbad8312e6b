"""Whether tensors or a model are sharded (DTensors), asked without importing DTensor's module."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeGuard

from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_dtensor(t: object) -> TypeGuard[DTensor]:
    """True when `t` is a DTensor (an FSDP2 or tensor-parallel parameter, or its state)."""
    module = sys.modules.get("torch.distributed.tensor")
    # Never imported means nothing is a DTensor; importing it to ask takes ~1 s.
    return module is not None and isinstance(t, module.DTensor)


def has_dtensors(tensors: Iterable[Any]) -> bool:
    """True when any of the tensors is a DTensor."""
    return any(is_dtensor(t) for t in tensors)


def is_sharded(model: nn.Module) -> bool:
    """True when the model's state holds DTensors: it was sharded by FSDP2 or tensor parallel."""
    return has_dtensors(model.state_dict().values())
