"""Value types of how `wrap_model` applies a strategy: `FSDPOptions` and the compile mode.

They sit below `RunContext` (which records what a launcher asked for) and import nothing of
accel's but `_typing`, so `accel.context` can name them without a circle.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import nn

from accel._typing import as_dtype

__all__ = ["FSDPOptions"]

CompileMode = Literal[False, True, "regional"]


def check_compile(fn: str, value: Any, *, name: str = "compile") -> CompileMode:
    """The one validator of a compile setting: False, True or "regional" (not 0, 1 or "yes")."""
    if value is False or value is True or value == "regional":
        return cast(CompileMode, value)
    raise ValueError(
        f"{fn}: {name}={value!r} must be False, True or 'regional'; False does not compile, "
        "True compiles the whole model, 'regional' each repeated block. Use compile=True."
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class FSDPOptions:
    """How `wrap_model` applies FSDP2 (`fully_shard`).

    Dtypes take a `torch.dtype` or its name ("bf16", "bfloat16", "torch.bfloat16"). Activation
    checkpointing is `wrap_model(..., activation_checkpointing=...)`, for every strategy; the
    field here still works but is deprecated.

    Example:
        >>> from accel import FSDPOptions
        >>> FSDPOptions(layer_classes=("Block",), param_dtype="bf16").param_dtype
        torch.bfloat16
    """

    layer_classes: tuple[type[nn.Module] | str, ...] = ()
    """Every submodule of these classes (or class names, as Accelerate's
    `fsdp_transformer_layer_cls_to_wrap` gives them) is its own FSDP2 unit, sharded before the
    root; they are also the units of activation checkpointing and regional compile."""
    reshard_after_forward: bool = True
    """Free gathered parameters after forward (less memory, one more all-gather in backward)."""
    param_dtype: torch.dtype | None = None
    """Dtype parameters are gathered and computed in. None: bf16 when ctx.precision is bf16
    (or fp16 for fp16), else the parameters' own dtype."""
    reduce_dtype: torch.dtype | None = None
    """Dtype gradients are reduced in. None: float32 whenever param_dtype is lower."""
    activation_checkpointing: bool = False
    """Deprecated: use `wrap_model(..., activation_checkpointing=True)`, which works under every
    strategy (True here still recomputes each layer-class block, with a DeprecationWarning)."""
    offload_params: bool = False
    """Keep sharded parameters and gradients on the CPU (FSDP2's CPUOffloadPolicy)."""
    sync_module_states: bool = False
    """Broadcast rank 0's parameters and buffers before sharding (different inits agree)."""

    def __post_init__(self) -> None:
        bad = [
            c
            for c in self.layer_classes
            if not (isinstance(c, str) or (isinstance(c, type) and issubclass(c, nn.Module)))
        ]
        if bad or not isinstance(self.layer_classes, tuple):
            raise ValueError(
                f"FSDPOptions: layer_classes contains {bad or self.layer_classes!r}; pass a "
                "tuple of nn.Module subclasses or class names, e.g. layer_classes=(Block,)."
            )
        for name in ("param_dtype", "reduce_dtype"):
            object.__setattr__(self, name, as_dtype("FSDPOptions", name, getattr(self, name)))
        for name in (
            "reshard_after_forward", "activation_checkpointing", "offload_params",
            "sync_module_states",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(
                    f"FSDPOptions: {name}={value!r} must be True or False. Use {name}=True."
                )
        if self.activation_checkpointing:
            warnings.warn(
                "FSDPOptions: activation_checkpointing=True is deprecated; pass "
                "wrap_model(ctx, model, activation_checkpointing=True) instead (it works under "
                "every strategy, DDP, tensor parallel and one process included).",
                DeprecationWarning,
                stacklevel=3,
            )
