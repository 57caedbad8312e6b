"""Value types of how `wrap_model` applies a strategy: `FSDPOptions`, the compile mode, and
`WrapDefaults` (what a launcher asked wrap_model for, held by `RunContext`).

They sit below `RunContext` and import nothing of accel's but `_typing`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from accel._typing import as_dtype
from accel_settings.values import CompileMode as CompileMode
from accel_settings.values import check_compile as check_compile

__all__ = ["FSDPOptions", "WrapDefaults"]


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


@dataclass(frozen=True, slots=True, kw_only=True)
class WrapDefaults:
    """What `wrap_model` applies when its call does not say: the launcher config's choices.

    `init_distributed` reads them from `accel launch` (its flags and Accelerate's YAML
    sections: `fsdp_config`, `dynamo_config`, `deepspeed_config`) into `ctx.wrap`; an argument
    of `wrap_model` (fsdp=, compile=, activation_checkpointing=, deepspeed=) wins over each.

    Example:
        >>> from accel import RunContext, WrapDefaults
        >>> RunContext(wrap=WrapDefaults(compile="regional")).wrap.compile
        'regional'
    """

    fsdp: FSDPOptions | None = None
    """FSDP2 options (`fsdp_config`); None: FSDPOptions() when FSDP2 applies."""
    activation_checkpointing: bool = False
    """Recompute each repeated block's activations in backward (`fsdp_activation_checkpointing`)."""
    compile: CompileMode = False
    """torch.compile (`dynamo_config`): False, True (the whole model) or "regional" (per block)."""
    compile_dynamic: bool | None = None
    """torch.compile's `dynamic=` (Accelerate's `dynamo_use_dynamic`): True traces dynamic
    shapes, False specialises on every shape, None (torch's default) recompiles with dynamic
    shapes once a shape changes."""
    deepspeed: tuple[tuple[str, Any], ...] | None = None
    """Accelerate's `deepspeed_config` section (distributed_type DEEPSPEED), as sorted pairs,
    each value read by its row; `wrap_model(strategy="auto")` builds a DeepSpeed engine from it."""

    def __post_init__(self) -> None:
        if self.fsdp is not None and not isinstance(self.fsdp, FSDPOptions):
            raise TypeError(
                f"WrapDefaults: fsdp={self.fsdp!r} must be an accel.FSDPOptions or None."
            )
        check_compile("WrapDefaults", self.compile)
        if self.compile_dynamic is not None and not isinstance(self.compile_dynamic, bool):
            raise TypeError(
                f"WrapDefaults: compile_dynamic={self.compile_dynamic!r} must be True, False or "
                "None (torch.compile's dynamic=)."
            )
        if not isinstance(self.activation_checkpointing, bool):
            raise TypeError(
                f"WrapDefaults: activation_checkpointing={self.activation_checkpointing!r} must "
                "be True or False."
            )
        if self.deepspeed is not None and not isinstance(self.deepspeed, tuple):
            raise TypeError(
                f"WrapDefaults: deepspeed={self.deepspeed!r} must be Accelerate's "
                "deepspeed_config section as sorted (key, value) pairs, or None."
            )


_WRAP_FIELDS = frozenset(f.name for f in dataclasses.fields(WrapDefaults))


def context_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """RunContext's keyword arguments for the settings `values` (field -> value): the ones that
    are `WrapDefaults` fields grouped into `wrap=`, every other one as it is."""
    found = {n: v for n, v in values.items() if n not in _WRAP_FIELDS}
    return {**found, "wrap": WrapDefaults(**{n: v for n, v in values.items() if n in _WRAP_FIELDS})}
